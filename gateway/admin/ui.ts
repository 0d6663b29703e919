import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { LRUCache } from 'lru-cache';
import { clientOf } from '../address.js';
import type { KeyFinder } from '../auth/key-finder.js';
import type { KeyStore } from '../auth/key-file.js';
import type { GatewayConfig } from '../config/config.js';
import { readAudit } from '../portal/audit.js';
import type { AccountFigures } from '../portal/figures.js';
import { operatorAccountPage, operatorSignInPage, overview, overviewPage } from '../portal/operator.js';
import { messagePage } from '../portal/pages.js';
import { sameOrigin, secure, send } from '../portal/routes.js';
import { cookieValue, PortalSessions, StoreUnavailable } from '../portal/sessions.js';
import type { AccountBook, Operations } from '../quota/store.js';
import type { RedisClient } from '../redis/client.js';
import { AuthThrottle } from './auth-throttle.js';

// The operator's page on the admin port, /admin/ui: signed in with ADMIN_TOKEN through a form
// (never in a URL), which opens a session cookie. With Redis its sessions are kept there (by
// digest, as the portal's), so every instance's admin port knows them and a sign-out ends them
// everywhere; while Redis fails, a session this process opened or read lately still opens the
// page, and a sign-in opens one in this process alone: the operator needs the page most then.
// Registered outside the bearer guard.

const COOKIE = 'admin_session';
/** The account name an operator's session holds in the shared store (in a namespace of its own, so no account's). */
const OPERATOR = '(operator)';
const SESSION_MS = 15 * 60_000;
const digest = (s: string) => createHash('sha256').update(s).digest();

export interface OperatorParts {
  adminToken?: string;
  config: () => GatewayConfig;
  store: AccountBook & Pick<Operations, 'degraded' | 'degradedReason'>;
  find: KeyFinder;
  /** With Redis: an account's figures and audit log. */
  figures?: AccountFigures;
  redis?: RedisClient;
  /** The key store the admin key API lists: the operator page lists its accounts a page at a time. */
  keys?: KeyStore;
  timeoutMs: number;
}

const cookie = (id: string, request: FastifyRequest, maxAgeMs = SESSION_MS) =>
  `${COOKIE}=${id}; Path=/admin/ui; HttpOnly; SameSite=Strict; Max-Age=${Math.floor(maxAgeMs / 1000)}${secure(request) ? '; Secure' : ''}`;

export async function operatorUi(app: FastifyInstance, parts: OperatorParts): Promise<void> {
  const token = parts.adminToken ? digest(parts.adminToken) : undefined;
  /** Sessions opened here while Redis failed (or without Redis). */
  const local = new LRUCache<string, { csrf: string }>({ max: 1000, ttl: SESSION_MS });
  const { redis, config, timeoutMs } = parts;
  const shared = redis && new PortalSessions(redis, () => `${config().redisPrefix}:operator`, timeoutMs);
  const throttle = new AuthThrottle();
  const sessionOf = async (request: FastifyRequest): Promise<{ csrf: string } | undefined> => {
    const id = cookieValue(request.headers.cookie, COOKIE);
    if (!id) return undefined;
    return (await shared?.get(id)) ?? local.get(id);
  };
  const open = async (): Promise<string> => {
    const opened = await shared?.open(OPERATOR, 'full').catch((err: Error) => {
      if (err instanceof StoreUnavailable) return undefined;
      throw err;
    });
    if (opened) return opened.id;
    const id = randomBytes(32).toString('base64url');
    local.set(id, { csrf: randomBytes(32).toString('base64url') });
    return id;
  };
  const signIn = (reply: FastifyReply, status: number, notice?: string) => send(reply, status, operatorSignInPage(notice));
  app.addContentTypeParser('application/x-www-form-urlencoded', { parseAs: 'string', bodyLimit: 4096 }, (_req, body, done) => {
    done(null, Object.fromEntries(new URLSearchParams(body as string)));
  });
  const hide = { schema: { hide: true } };

  app.get('/admin/ui', hide, async (request, reply) => {
    const session = await sessionOf(request);
    if (!session) return signIn(reply, 200);
    const after = (request.query as Record<string, unknown>).after;
    if (after !== undefined && (typeof after !== 'string' || !/^[a-z0-9_-]{1,64}$/.test(after)))
      return send(reply, 400, messagePage('Not a page', 'That is not a page of the account list.', '/admin/ui'));
    return send(reply, 200, overviewPage(await overview(parts, after), session.csrf));
  });

  app.post('/admin/ui/sign-in', hide, async (request, reply) => {
    const client = clientOf(request.ip);
    if (!sameOrigin(request)) return signIn(reply, 403, 'Sign in from this page itself.');
    if (throttle.retryAfter(client) > 0) return signIn(reply, 429, 'Too many failed sign-ins from this address: wait a minute.');
    const given = (request.body as Record<string, string> | undefined)?.token ?? '';
    if (!token || !timingSafeEqual(digest(given), token)) {
      throttle.failed(client);
      return signIn(reply, 401, token ? 'That token is not the admin token.' : 'ADMIN_TOKEN is not set: nobody can sign in.');
    }
    reply.header('set-cookie', cookie(await open(), request));
    return reply.code(303).header('location', '/admin/ui').header('cache-control', 'no-store').send();
  });

  app.post('/admin/ui/sign-out', hide, async (request, reply) => {
    const session = await sessionOf(request);
    const form = request.body as Record<string, string> | undefined;
    if (!session || !sameOrigin(request) || form?.csrf !== session.csrf) return signIn(reply, 403, 'Sign out from the page itself.');
    const id = cookieValue(request.headers.cookie, COOKIE)!;
    local.delete(id);
    await shared?.end(id).catch(() => undefined); // Redis failing: it ends at its expiry
    reply.header('set-cookie', cookie('', request, 0));
    return reply.code(303).header('location', '/admin/ui').header('cache-control', 'no-store').send();
  });

  app.get('/admin/ui/accounts/:account', hide, async (request, reply) => {
    if (!(await sessionOf(request))) return signIn(reply, 401, 'Sign in first.');
    const { account } = request.params as { account: string };
    const back = '/admin/ui';
    if (!parts.figures || !parts.redis) return send(reply, 503, messagePage('No Redis', 'Account figures need Redis (REDIS_URL).', back));
    const f = await parts.figures.read(account);
    if (f.keys.length === 0) return send(reply, 404, messagePage('No such account', 'No key is in that account.', back));
    const [member] = await parts.figures.members(account);
    const audit = f.unavailable ? [] : await readAudit(parts.redis, member!.subject.name).catch(() => []);
    // The export's reconcile, as the account's usage lookup gives it (admin/usage.ts).
    const { store } = parts;
    const reconcile =
      f.unavailable || !store.exportState || member!.subject.events === 0 || store.degraded
        ? undefined
        : await store.exportState(member!.subject).catch(() => undefined);
    return send(reply, 200, operatorAccountPage(f, audit, reconcile));
  });
}
