import type { Server } from 'node:http';
import type { Socket } from 'node:net';
import { createHash, timingSafeEqual } from 'node:crypto';
import swagger, { type SwaggerOptions } from '@fastify/swagger';
import { type FastifyPluginAsyncTypebox, type TypeBoxTypeProvider, TypeBoxValidatorCompiler } from '@fastify/type-provider-typebox';
import { Type } from '@sinclair/typebox';
import Fastify, { type FastifyBaseLogger, type FastifyInstance, type FastifySchemaValidationError, LogController } from 'fastify';
import { clientOf } from '../address.js';
import { connectionRefusal, isRefusal, probeAccess, type RedisClient, within } from '../redis/client.js';
import type { GatewayConfig } from '../config/config.js';
import { GatewayError, handleError } from '../errors.js';
import type { AccountBook, Operations } from '../quota/store.js';
import { fileKeys, type KeyStore, type OtherKeys } from '../auth/key-file.js';
import { type KeyFinder, keyFinder } from '../auth/key-finder.js';
import { AuthThrottle, FAILURES_PER_MINUTE } from './auth-throttle.js';
import { keyApi } from './keys.js';
import { failure, Health, Ready, SharedError } from './schemas.js';
import { alertRoutes, statementRoutes, usageRoutes } from './usage.js';
import { creditRoutes } from './credits.js';
import { portalAdminRoutes } from './portal.js';
import { PortalSessions } from '../portal/sessions.js';
import { AccountFigures } from '../portal/figures.js';
import { operatorUi } from './ui.js';
import { defineStandingScripts, recordBalance } from '../portal/standing.js';
import { recentDeliveries } from '../usage/webhooks.js';

/** What the admin port takes from the settings. */
export interface AdminSettings {
  backendUrl: string;
  adminToken?: string;
  /** GATEWAY_REQUEST_TIMEOUT_MS: a request's headers and body must arrive within it, as on the public port. */
  requestTimeoutMs: number;
  /** REDIS_TIMEOUT_MS: the portal's Redis calls wait no longer (1 s when left out). */
  redisTimeoutMs?: number;
  /** The public origin portal links point at (PORTAL_URL, else the gateway's own address once it listens); relative links when left out. */
  portalUrl?: () => string;
  /** The config file the account settings edit (the same locked, validated edit as the keys command). */
  configFile?: string;
}

/** What the admin port reads from the running instance. */
export interface AdminParts {
  config: () => GatewayConfig;
  /** Its health for readiness, the unban, and the account book for the usage and credit routes. */
  store: AccountBook & Operations;
  /** The Prometheus text: this process's registry, or every worker's, aggregated. */
  metrics: { contentType: string; text(): Promise<string> };
  /** Problems that make this instance unready beyond Redis and the backend (a worker down, a worker's key registry). */
  problems?: () => string[] | Promise<string[]>;
  /** Answers to what Node refuses before fastify has a request (http/raw-answers.ts, handed in by the wiring). */
  rawAnswers: { install(server: Server): void; clientError(err: Error & { code?: string }, socket: Socket): void };
  /** What /readyz reports beside a 200 (the key registry's lost keys, here or in a worker). */
  warnings?: () => string[] | Promise<string[]>;
  redis?: RedisClient;
  /** Where the key API issues keys (the config file, or the key registry); none: no key API here. */
  keys?: KeyStore;
  /** Keys by id and accounts by name, for the lookups; the config's keys alone when left out. */
  find?: KeyFinder;
  /** The key registry's accounts, which may take settings in the file though none of their keys is there. */
  accounts?: OtherKeys;
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
async function redisProblems(redis: RedisClient, store: Operations): Promise<string[]> {
  const what = redisName(redis);
  const alone = 'each instance counts alone meanwhile';
  const refused = () => connectionRefusal(redis);
  if (redis.status !== 'ready') {
    const r = refused();
    return [r ? `${what}: refused: ${r}; ${alone}` : `${what}: not connected (${redis.status}); the gateway keeps trying`];
  }
  // Declared failing by the quota store: no need to wait for a call's own timeout to say so.
  if (store.degraded) {
    const reason = store.degradedReason;
    const r = refused() ?? (reason && isRefusal(reason) ? reason : undefined);
    return [r ? `${what}: refused: ${r}; ${alone}` : `${what}: connected but not answering in time`];
  }
  // A call the gateway's user must be allowed (a script), in place of PING: NOAUTH and NOPERM show before a request meets them.
  const problem = await probeAccess(redis);
  if (problem === undefined) return [];
  const r = refused();
  if (r) return [`${what}: refused: ${r}; ${alone}`];
  return [/timed out/i.test(problem) ? `${what}: connected but not answering in time` : `${what}: ${problem}`];
}

/** Everything that keeps this instance from taking traffic; none when it is ready. */
async function readinessProblems(deps: AdminDeps): Promise<string[]> {
  const problems: string[] = [];
  if (deps.closing()) problems.push('shutting down');
  problems.push(...((await deps.problems?.()) ?? []));
  if (deps.redis) problems.push(...(await redisProblems(deps.redis, deps.store)));
  await fetch(`${deps.backendUrl}/healthz`, { signal: AbortSignal.timeout(1000) }).then(
    (res) => {
      if (!res.ok) problems.push(`backend: status ${res.status}`);
    },
    (err: Error) => problems.push(`backend: ${err.cause ? String((err.cause as Error).message) : err.message}`),
  );
  return problems;
}

/** A schema's refusal as the catalogue's bad_request, naming the first field at fault: `body.limits.perMinute: Expected integer`. */
function schemaError(errors: FastifySchemaValidationError[], part: string): GatewayError {
  const [first] = errors;
  const field = [part, ...(first?.instancePath.split('/').filter(Boolean) ?? [])].join('.');
  return new GatewayError('bad_request', `${field}: ${first?.message ?? 'invalid'}`);
}

const DOCUMENT: SwaggerOptions = {
  openapi: {
    openapi: '3.1.0',
    info: {
      title: 'Pet Store gateway: admin port',
      version: '1.0.0',
      description:
        'Health, readiness, metrics, usage, credits and the key API. Served on ADMIN_HOST:ADMIN_PORT only, never on the public port.',
    },
    tags: [
      { name: 'operations', description: 'For load balancers, Prometheus and tooling: no token' },
      { name: 'usage', description: 'What a key or an account has used, from the store the gateway enforces with' },
      { name: 'keys', description: 'The keys command over HTTP: create, list, rotate, revoke, account settings' },
      { name: 'credits', description: "An account's prepaid credits: balance, ledger and top-ups" },
      { name: 'portal', description: 'The usage portal: sign-in links for account holders, and the audit log of their sessions' },
    ],
    components: { securitySchemes: { adminToken: { type: 'http', scheme: 'bearer', description: 'ADMIN_TOKEN' } } },
  },
  // Shared schemas under their own names (Error), not def-0.
  refResolver: { buildLocalReference: (json, _base, _fragment, i) => String(json.$id ?? `def-${i}`) },
};

/** The server itself: TypeBox validation, the one error renderer, one access line per request. */
function adminServer(log: FastifyBaseLogger, requestTimeoutMs: number, raw: AdminParts['rawAnswers']) {
  const app = Fastify({
    loggerInstance: log,
    // A body that stops arriving is cut with 408 (in the Error shape, by the client error handler)
    // instead of holding its connection for good: fastify's default is no timeout at all.
    requestTimeout: requestTimeoutMs,
    http: { headersTimeout: requestTimeoutMs, connectionsCheckingInterval: Math.min(1000, requestTimeoutMs) },
    // One line per request, as on the public port, instead of fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    return503OnClosing: false,
    frameworkErrors: (err, request, reply) => handleError(err, request, reply),
    // Oversized headers and bad framing in the Error shape too, not fastify's {error, message, statusCode}.
    clientErrorHandler: raw.clientError,
    schemaErrorFormatter: schemaError,
  }).withTypeProvider<TypeBoxTypeProvider>();
  // TypeBox's own checker: a body is never coerced ("5" is not an integer), unlike fastify's default Ajv.
  app.setValidatorCompiler(TypeBoxValidatorCompiler);
  app.addSchema(SharedError);
  app.setErrorHandler(handleError);
  app.addHook('onResponse', async (request, reply) => {
    const ms = Math.round(reply.elapsedTime * 10) / 10;
    request.log.info({ method: request.method, url: request.url, status: reply.statusCode, ms, address: request.ip }, 'admin request');
  });
  app.setNotFoundHandler(() => {
    throw new GatewayError('route_not_found', 'No such admin route');
  });
  raw.install(app.server);
  return app;
}

/** Health, readiness, metrics and this document: open to anyone who reaches the admin port. */
const operations: FastifyPluginAsyncTypebox<AdminDeps> = async (app, deps) => {
  const tags = ['operations'];
  app.get('/healthz', { schema: { operationId: 'health', tags, response: { 200: Health } } }, async () => ({ status: 'ok' as const }));

  app.get(
    '/readyz',
    { schema: { operationId: 'ready', tags, response: { 200: Ready, 503: failure('not_ready, with the reasons') } } },
    async (_request, reply) => {
      const problems = await readinessProblems(deps);
      if (problems.length > 0) throw new GatewayError('not_ready', `Not ready: ${problems.join('; ')}`);
      reply.header('cache-control', 'no-store');
      const warnings = (await deps.warnings?.()) ?? [];
      return {
        status: 'ready' as const,
        store: deps.redis ? ('redis' as const) : ('memory' as const),
        ...(warnings.length > 0 && { warnings }),
      };
    },
  );

  const prometheus = { description: 'Prometheus text format', content: { 'text/plain': { schema: Type.String() } } };
  app.get('/metrics', { schema: { operationId: 'metrics', tags, response: { 200: prometheus } } }, async (_request, reply) => {
    reply.type(deps.metrics.contentType);
    return deps.metrics.text();
  });

  const document = Type.Object({}, { additionalProperties: true, description: 'This document' });
  app.get('/openapi.json', { schema: { operationId: 'adminDocument', tags, response: { 200: document } } }, async () => app.swagger());
};

/**
 * /admin/*: every route registered in this scope answers 401 without the admin token, in
 * onRequest (so before its body is parsed or validated), and is documented as guarded.
 */
function guard(scope: FastifyInstance, adminToken: string | undefined): void {
  const token = adminToken ? digest(adminToken) : undefined;
  if (!token) scope.log.warn('ADMIN_TOKEN is not set: /admin/* answers 401 to everyone');
  const unauthorized = failure('unauthorized: the admin token is missing or wrong, or ADMIN_TOKEN is not set');
  const throttled = failure(
    `rate_limited: ${FAILURES_PER_MINUTE} failed authentications from this address in a minute; Retry-After says when to try again`,
  );
  scope.addHook('onRoute', (route) => {
    route.schema = {
      ...route.schema,
      security: [{ adminToken: [] }],
      response: { ...(route.schema?.response as object), 401: unauthorized, 429: throttled },
    };
  });
  const throttle = new AuthThrottle();
  scope.addHook('onRequest', async (request) => {
    const client = clientOf(request.ip); // a guesser's IPv6 addresses are one client: its /64
    const retry = throttle.retryAfter(client);
    if (retry > 0) {
      throw new GatewayError('rate_limited', `Too many failed admin authentications from this address; retry after ${retry} s`, {
        'retry-after': String(retry),
      });
    }
    const given = /^Bearer (\S+)$/i.exec(request.headers.authorization ?? '')?.[1];
    if (!token || !given || !timingSafeEqual(digest(given), token)) {
      if (throttle.failed(client))
        request.log.warn(
          { address: request.ip },
          `admin: ${FAILURES_PER_MINUTE} failed authentications in a minute; address refused until it ends`,
        );
      throw new GatewayError('unauthorized', token ? 'Admin token missing or wrong' : 'ADMIN_TOKEN is not configured', {
        'www-authenticate': 'Bearer realm="pet-store-admin"',
      });
    }
  });
}

/**
 * The admin surface, on its own port and never on the public one: health, readiness,
 * Prometheus metrics, and behind ADMIN_TOKEN a key's usage and the key API. Its OpenAPI
 * document is generated from the routes' schemas.
 */
export async function buildAdmin(settings: AdminSettings, parts: AdminParts): Promise<FastifyInstance> {
  const deps: AdminDeps & { find: KeyFinder } = {
    ...settings,
    ...parts,
    find: parts.find ?? keyFinder(parts.config),
    // The list pages over the config in force, which every reload has parsed already.
    keys: parts.keys ?? (settings.configFile ? fileKeys(settings.configFile, {}, parts.config) : undefined),
  };
  const app = adminServer(deps.log, deps.requestTimeoutMs, deps.rawAnswers);
  await app.register(swagger, DOCUMENT);
  await app.register(operations, deps);
  // The operator's page: its own form sign-in and session cookie, so outside the bearer guard.
  const timeoutMs = deps.redisTimeoutMs ?? 1000;
  const figures = deps.redis
    ? new AccountFigures({ store: deps.store, find: deps.find, redis: deps.redis, timeoutMs, config: deps.config })
    : undefined;
  await app.register(async (scope) => operatorUi(scope, { ...deps, figures, timeoutMs }));
  await app.register(async (scope) => {
    guard(scope, deps.adminToken);
    const deliveries = deps.redis ? () => recentDeliveries(deps.redis!, deps.config()) : undefined;
    await scope.register(usageRoutes, { config: deps.config, store: deps.store, redis: deps.redis !== undefined, find: deps.find });
    await scope.register(statementRoutes, {
      config: deps.config,
      store: deps.store,
      redis: deps.redis !== undefined,
      find: deps.find,
      statements: deps.redis,
    });
    await scope.register(alertRoutes, { deliveries });
    const redis = deps.redis;
    if (redis) defineStandingScripts(redis);
    const balanceSeen =
      redis &&
      (async (name: string, atMs: number, balance: number) => {
        await within(recordBalance(redis, deps.config().redisPrefix, name, atMs, balance), timeoutMs);
      });
    await scope.register(creditRoutes, { store: deps.store, find: deps.find, balanceSeen });
    await scope.register(keyApi, { keys: deps.keys, configFile: deps.configFile, accounts: deps.accounts });
    const sessions = deps.redis ? new PortalSessions(deps.redis, () => deps.config().redisPrefix, deps.redisTimeoutMs ?? 1000) : undefined;
    await scope.register(portalAdminRoutes, { find: deps.find, sessions, redis: deps.redis, portalUrl: deps.portalUrl ?? (() => '') });
  });
  return app;
}
