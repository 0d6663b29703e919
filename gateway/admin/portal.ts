import type { FastifyPluginAsyncTypebox } from '@fastify/type-provider-typebox';
import { Type } from '@sinclair/typebox';
import type { KeyFinder } from '../auth/key-finder.js';
import { GatewayError } from '../errors.js';
import { readAudit } from '../portal/audit.js';
import type { PortalSessions } from '../portal/sessions.js';
import type { RedisClient } from '../redis/client.js';
import { AccountParams, failure } from './schemas.js';

// The portal on the admin port: single-use links that open a full session (self-service) for
// one account, and the audit log of what those sessions did.

const Instant = Type.String({ format: 'date-time' });

const PortalLink = Type.Object(
  {
    url: Type.String({ description: 'Opens a full portal session for the account, once; give it to the account holder only' }),
    expiresAt: Instant,
  },
  { title: 'PortalLink' },
);

const Audit = Type.Object(
  {
    account: Type.String(),
    entries: Type.Array(
      Type.Object({
        id: Type.String({ description: 'The stream entry id (time, then sequence)' }),
        at: Instant,
        who: Type.String({ description: "`<account>/session:<tag>`: the session's first 8 characters" }),
        action: Type.Union([Type.Literal('create'), Type.Literal('rotate'), Type.Literal('revoke')]),
        keyId: Type.String(),
        newKeyId: Type.Optional(Type.String({ description: "A rotation's new key" })),
      }),
      { description: 'The last 100 actions, newest first (about the last 1,000 are kept)' },
    ),
  },
  { title: 'PortalAudit' },
);

export interface PortalAdminParts {
  find: KeyFinder;
  /** Sessions and links in Redis; none without it (the portal needs Redis). */
  sessions?: PortalSessions;
  redis?: RedisClient;
  /** The public origin the links point at: PORTAL_URL, else the gateway's own address. */
  portalUrl: () => string;
}

const noRedis = () => new GatewayError('route_not_found', 'The portal needs Redis (REDIS_URL): there is none here');

export const portalAdminRoutes: FastifyPluginAsyncTypebox<PortalAdminParts> = async (app, parts) => {
  const tags = ['portal'];
  const notFound = failure('key_not_found: no key in that account; route_not_found: no Redis, so no portal');
  /** The account, if some key is in it: a link to an account nobody holds would open an empty page. */
  const known = async (account: string) => {
    const [member] = await parts.find.account(account);
    if (!member) throw new GatewayError('key_not_found', `No key in account "${account}"`);
    return member;
  };
  const unavailable = (err: Error): never => {
    app.log.warn({ cause: err.message }, 'portal: Redis did not answer');
    throw new GatewayError('quota_store_unavailable', 'Redis did not answer; ask again');
  };

  app.post(
    '/admin/accounts/:account/portal-links',
    {
      schema: {
        operationId: 'mintPortalLink',
        tags,
        description:
          'A single-use link (15 minutes) that opens a full portal session for the account: its usage, and key create, rotate and revoke.',
        params: AccountParams,
        response: {
          201: PortalLink,
          400: failure('bad_request: a malformed account name'),
          404: notFound,
          503: failure('quota_store_unavailable'),
        },
      },
    },
    async (request, reply) => {
      if (!parts.sessions) throw noRedis();
      await known(request.params.account);
      const { token, expiresMs } = await parts.sessions.mint(request.params.account).catch(unavailable);
      reply.code(201).header('cache-control', 'no-store');
      return { url: `${parts.portalUrl()}/portal/link?token=${token}`, expiresAt: new Date(expiresMs).toISOString() };
    },
  );

  app.get(
    '/admin/accounts/:account/audit',
    {
      schema: {
        operationId: 'portalAudit',
        tags,
        description: "What the account's portal sessions did: keys created, rotated and revoked, by whom and when.",
        params: AccountParams,
        response: {
          200: Audit,
          400: failure('bad_request: a malformed account name'),
          404: notFound,
          503: failure('quota_store_unavailable'),
        },
      },
    },
    async (request) => {
      if (!parts.redis) throw noRedis();
      const member = await known(request.params.account);
      const entries = await readAudit(parts.redis, member.subject.name).catch(unavailable);
      return { account: request.params.account, entries };
    },
  );
};
