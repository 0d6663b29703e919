import type { FastifyInstance, FastifyPluginAsync, FastifyReply, FastifyRequest } from 'fastify';
import { authenticate, type KeyLookup } from '../auth/authenticate.js';
import { KeyFileError, type KeyStore } from '../auth/key-file.js';
import { REGISTRY_WHERE } from '../auth/registry.js';
import type { GatewayConfig, KeyLimits } from '../config/config.js';
import { type LimitField, WINDOWS } from '../quota/windows.js';
import { GatewayError } from '../errors.js';
import type { RedisClient } from '../redis/client.js';
import { type AuditRecord, writeAudit } from './audit.js';
import { type AccountFigures, figuresCsv } from './figures.js';
import { CSP, html } from './html.js';
import { dashboardPage, linkPage, messagePage, secretPage, signInPage } from './pages.js';
import { COOKIE, cookieValue, csrfMatches, type PortalSessions, type Session, sessionCookie, StoreUnavailable } from './sessions.js';

// The portal's routes on the public port, registered under the prefix /portal. Every query is filtered by the session's account, as
// the server holds it: a key id from a form is checked to be that account's before anything is
// done with it, and no route takes an account from the request. Answers are HTML (CSV for the
// download); refusals are pages with a plain sentence, never a stack.

export interface PortalParts {
  config: () => GatewayConfig;
  sessions: PortalSessions;
  figures: AccountFigures;
  redis: RedisClient;
  /** The key registry, for a sign-in with a key beyond the config file's. */
  lookup?: KeyLookup;
  /** Where keys are issued (the admin key API's store); none: no self-service on this instance. */
  keys?: KeyStore;
  /** The grace a rotated key keeps working through. */
  rotateGraceMs: number;
}

type Form = Record<string, string>;

/**
 * Every portal answer: never cached, never framed, no script. A referrer is only ever the origin
 * (a link's token never leaves in one); `no-referrer` would make browsers send `Origin: null`
 * on the forms, and the Origin check needs it.
 */
export function send(reply: FastifyReply, status: number, body: string, type = 'text/html; charset=utf-8'): FastifyReply {
  return reply
    .code(status)
    .header('content-type', type)
    .header('cache-control', 'no-store')
    .header('content-security-policy', CSP)
    .header('referrer-policy', 'strict-origin')
    .header('x-content-type-options', 'nosniff')
    .send(body);
}

export const secure = (request: FastifyRequest) => request.protocol === 'https';

/** A POST from a page of this origin: the Origin header (browsers send it on every POST) names this very host. */
export function sameOrigin(request: FastifyRequest): boolean {
  return request.headers.origin === `${request.protocol}://${request.host}`;
}

/** What a key store's refusal tells the consumer: its own sentence where it is about the request, else a generic one (a file path is the operator's). */
function keyProblem(err: unknown): never {
  if (err instanceof KeyFileError && (err.kind === 'invalid' || err.kind === 'not_found'))
    throw new GatewayError('bad_request', err.reason);
  if (err instanceof KeyFileError) throw new GatewayError('config_busy', 'Keys cannot be changed right now; try again in a moment');
  throw err;
}

/** The scope's own parsing and answers: forms only, HTML refusals, and every other path here. */
function setUp(app: FastifyInstance): void {
  // Forms only, and small: the fields are a key, a CSRF token and a key id.
  app.addContentTypeParser('application/x-www-form-urlencoded', { parseAs: 'string', bodyLimit: 4096 }, (_req, body, done) => {
    done(null, Object.fromEntries(new URLSearchParams(body as string)));
  });
  app.setErrorHandler((err: Error & { statusCode?: number }, request, reply) => {
    if (err instanceof GatewayError)
      return send(reply.headers(err.headers), err.status, messagePage(`Refused (${err.status})`, err.message));
    if (err instanceof StoreUnavailable)
      return send(reply, 503, messagePage('Data unavailable', 'The quota store is not answering; try again shortly.'));
    const status = err.statusCode && err.statusCode < 500 ? err.statusCode : 500;
    if (status === 500) request.log.error({ err }, 'portal: request failed');
    return send(
      reply,
      status,
      messagePage(`Error (${status})`, status === 500 ? 'Something went wrong on our side.' : 'The request could not be processed.'),
    );
  });
  // Every other path and method under /portal is answered here: the proxy's catch-all route
  // must never see one (it would forward a request no key admitted).
  const notFound = (_request: FastifyRequest, reply: FastifyReply) =>
    send(reply, 404, messagePage('Not found', 'There is no such page in the portal.'));
  app.all('/*', notFound);
  app.route({ method: ['POST', 'PUT', 'DELETE', 'PATCH', 'OPTIONS'], url: '/', handler: notFound });
}

/** The request's session, or the refusal: 401 without one, 403 for a form without its CSRF token or from another origin. */
const sessionReader =
  (sessions: PortalSessions) =>
  async (request: FastifyRequest, form?: { full?: boolean }): Promise<Session> => {
    const session = await sessions.get(cookieValue(request.headers.cookie, COOKIE));
    if (!session) throw new GatewayError('unauthorized', 'No session, or it has ended: sign in again at /portal');
    if (request.method === 'POST') {
      if (!sameOrigin(request) || !csrfMatches(session, (request.body as Form | undefined)?.csrf))
        throw new GatewayError(
          'csrf_failed',
          'This form did not come from the portal page (its origin or token is wrong): reload the page and try again',
        );
    }
    if (form?.full && session.mode !== 'full')
      throw new GatewayError(
        'unauthorized',
        'A session opened with an API key is read only: keys are managed through a portal link from your provider',
      );
    return session;
  };

export const portalRoutes: FastifyPluginAsync<PortalParts> = async (app, parts) => {
  setUp(app);
  const sessionOf = sessionReader(parts.sessions);
  pages(app, parts, sessionOf);
  selfService(app, parts, sessionOf);
};

type SessionOf = ReturnType<typeof sessionReader>;

/** Sign-in (by key, by link), sign-out, the page and its CSV. */
function pages(app: FastifyInstance, parts: PortalParts, sessionOf: SessionOf): void {
  const { sessions, figures } = parts;
  app.get('/', async (request, reply) => {
    const cookie = cookieValue(request.headers.cookie, COOKIE);
    const session = await sessions.get(cookie);
    if (!session) return send(reply, cookie ? 401 : 200, signInPage(cookie ? 'Your session has ended: sign in again.' : undefined));
    return send(reply, 200, dashboardPage(await figures.read(session.account), session));
  });

  app.post('/sign-in', async (request, reply) => {
    if (!sameOrigin(request)) throw new GatewayError('csrf_failed', 'Sign in from the portal page itself');
    const key = (request.body as Form | undefined)?.key ?? '';
    // Checked as the gateway checks a bearer key: revoked and expired keys sign nobody in.
    const who = await authenticate(`Bearer ${key}`, parts.config(), undefined, parts.lookup);
    if (who instanceof GatewayError) return send(reply, 401, signInPage('That key was not accepted: check it and try again.'));
    const { id } = await sessions.open(who.account, 'read');
    reply.header('set-cookie', sessionCookie(id, secure(request)));
    return reply.code(303).header('location', '/portal').header('cache-control', 'no-store').send();
  });

  const linkRefused = (reply: FastifyReply) =>
    send(reply, 401, messagePage('Link not valid', 'This portal link was used already, has expired, or is mistyped: ask for a new one.'));
  // Looking at a link spends nothing (a mail scanner's prefetch is a GET): its page's button does.
  app.get('/link', async (request, reply) => {
    const given = (request.query as Record<string, unknown>).token;
    const token = typeof given === 'string' ? given : ''; // a repeated ?token= is no token
    if (!(await sessions.usable(token))) return linkRefused(reply);
    return send(reply, 200, linkPage(token));
  });

  // The token is the form's own CSRF token (only its holder can post it); the Origin check keeps
  // another site from signing a visitor into an account of its choosing with a token of its own.
  app.post('/link', async (request, reply) => {
    if (!sameOrigin(request)) throw new GatewayError('csrf_failed', 'Open the link from its own page');
    const given = (request.body as Form | undefined)?.token;
    const account = await sessions.redeem(typeof given === 'string' ? given : '');
    if (!account) return linkRefused(reply);
    const { id } = await sessions.open(account, 'full');
    reply.header('set-cookie', sessionCookie(id, secure(request)));
    return reply.code(303).header('location', '/portal').header('cache-control', 'no-store').send();
  });

  app.post('/sign-out', async (request, reply) => {
    await sessionOf(request);
    await sessions.end(cookieValue(request.headers.cookie, COOKIE)!);
    reply.header('set-cookie', sessionCookie('', secure(request), 0));
    return reply.code(303).header('location', '/portal').header('cache-control', 'no-store').send();
  });

  app.get('/usage.csv', async (request, reply) => {
    const session = await sessionOf(request);
    const f = await figures.read(session.account);
    if (f.unavailable) {
      const last = f.unavailable.lastGoodMs;
      return send(
        reply,
        503,
        `data unavailable${last ? `; last good figures at ${new Date(last).toISOString()}` : ''}\r\n`,
        'text/csv; charset=utf-8',
      );
    }
    reply.header('content-disposition', `attachment; filename="usage-${session.account}.csv"`);
    return send(reply, 200, figuresCsv(f), 'text/csv; charset=utf-8');
  });
}

/** Create, rotate and revoke, for a full session; each action in the account's audit log. */
function selfService(app: FastifyInstance, parts: PortalParts, sessionOf: SessionOf): void {
  const { figures } = parts;
  const store = () => {
    if (!parts.keys) throw new GatewayError('route_not_found', 'Keys cannot be managed on this server: ask your provider');
    return parts.keys;
  };
  /** The session's account's key with this id, or 404: another account's id is as unknown as one that never was. */
  const ownKey = async (session: Session, id: unknown) => {
    const members = await figures.members(session.account);
    const key = typeof id === 'string' ? members.find((c) => c.id === id) : undefined;
    if (!key) throw new GatewayError('key_not_found', 'No such key in your account');
    return { key, members };
  };
  const audit = async (session: Session, subjectName: string, record: Omit<AuditRecord, 'who'>) => {
    await writeAudit(parts.redis, subjectName, { who: `${session.account}/session:${session.tag}`, ...record });
  };

  app.post('/keys', async (request, reply) => {
    const session = await sessionOf(request, { full: true });
    const [first] = await figures.members(session.account);
    if (!first) throw new GatewayError('key_not_found', 'No key in your account to take the plan from');
    const plan = parts.config().plans[first.plan];
    // A custom plan has no limits of its own: the new key takes the account's first key's windows
    // and short policies (concurrency, burst), which the account's keys must agree on.
    const own = first.subject.limits as Partial<Record<LimitField, number>>;
    const limits = plan?.custom
      ? {
          ...Object.fromEntries(WINDOWS.filter((w) => (own[w.limit] ?? 0) > 0).map((w) => [w.limit, own[w.limit]])),
          ...first.subject.short,
        }
      : undefined;
    const created = await store()
      .create({ plan: first.plan, account: session.account, ...(limits && { limits: limits as KeyLimits }) })
      .catch(keyProblem);
    await audit(session, first.subject.name, { action: 'create', keyId: created.id });
    return send(
      reply,
      201,
      secretPage(
        'Key created',
        created.id,
        created.key,
        store().where === REGISTRY_WHERE
          ? 'It works at once here, and on every gateway within tens of milliseconds.'
          : 'It works within about a second, once every gateway has read it.',
      ),
    );
  });

  app.post('/keys/rotate', async (request, reply) => {
    const session = await sessionOf(request, { full: true });
    const { key } = await ownKey(session, (request.body as Form).id);
    const rotated = await store().rotate(key.id, parts.rotateGraceMs).catch(keyProblem);
    await audit(session, key.subject.name, { action: 'rotate', keyId: key.id, newKeyId: rotated.id });
    const note = `The old key ${key.id} keeps working until ${rotated.oldExpiresAt}, then is refused.`;
    return send(reply, 201, secretPage('Key rotated', rotated.id, rotated.key, note));
  });

  app.post('/keys/revoke', async (request, reply) => {
    const session = await sessionOf(request, { full: true });
    const { key } = await ownKey(session, (request.body as Form).id);
    await store().revoke(key.id).catch(keyProblem);
    await audit(session, key.subject.name, { action: 'revoke', keyId: key.id });
    const f = await figures.read(session.account);
    const notice = html`<p role="status">Key ${key.id} is revoked: it is refused within about a second.</p>`;
    return send(reply, 200, dashboardPage(f, session, notice));
  });
}

/** What `/portal` says on a gateway without Redis (`npm start`'s in-process store): what to do about it. */
export const PORTAL_OFF =
  'The usage portal keeps its sessions and figures in Redis, and this gateway runs without it (REDIS_URL is not set). ' +
  'Start it with REDIS_URL=redis://127.0.0.1:6379 npm start beside a local redis-server, or with docker compose up, which brings one.';

/**
 * Without Redis there is nowhere to keep sessions: the portal says so instead of pretending,
 * to a sign-in form's POST too (answered before its body is read, so never a parser's 400).
 */
export const portalOff: FastifyPluginAsync = async (app) => {
  // Answered here, and `done` never called: the request goes no further (Fastify's hooks guide).
  app.addHook('onRequest', (_r: FastifyRequest, reply: FastifyReply) => {
    send(reply, 503, messagePage('Portal unavailable', PORTAL_OFF));
  });
  const never = async () => undefined; // the hook has answered
  app.all('/', never);
  app.all('/*', never);
};
