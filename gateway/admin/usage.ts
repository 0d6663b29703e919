import type { FastifyPluginAsyncTypebox } from '@fastify/type-provider-typebox';
import type { KeyFinder } from '../auth/key-finder.js';
import type { Consumer, GatewayConfig } from '../config/config.js';
import { GatewayError } from '../errors.js';
import type { AccountBook, Operations } from '../quota/store.js';
import { usageView } from '../quota/usage-view.js';
import type { Delivery } from '../usage/webhooks.js';
import type { RedisClient } from '../redis/client.js';
import { accountStatement, StatementSchema } from '../usage/statements.js';
import { Type } from '@sinclair/typebox';
import { AccountParams, AccountUsage, Deliveries, failure, KeyParams, KeyUsage, Unbanned, type Usage } from './schemas.js';

export interface UsageParts {
  config: () => GatewayConfig;
  /** The account book, and the operator's unban; `degraded` names the store the numbers come from. */
  store: AccountBook & Pick<Operations, 'degraded' | 'unban'>;
  /** Whether the gateway enforces with Redis; else with its in-process store. */
  redis: boolean;
  /** Keys by id and accounts by name (the file's and the key registry's). */
  find: KeyFinder;
  /** Where the usage statements are read (usage/statements.ts); none without Redis. */
  statements?: RedisClient;
}

/** An account's windows, ban and recent 429s, read from the store the gateway enforces with. */
async function usageOf(consumer: Consumer, { store, redis }: UsageParts): Promise<Usage> {
  const usage = await store.peek(consumer.subject);
  const view = { ...usageView(consumer, usage), store: redis ? (store.degraded ? 'memory (Redis failing)' : 'redis') : 'memory' } as Usage;
  // Exported usage reconciled: every event written is exported, pending or dropped.
  if (consumer.subject.events > 0 && store.exportState && !store.degraded) view.events = await store.exportState(consumer.subject);
  return view;
}

/** The usage lookups, by key and by account. A key's usage is its account's: the keys of one account share one quota. */
export const usageRoutes: FastifyPluginAsyncTypebox<UsageParts> = async (app, parts) => {
  app.get(
    '/admin/keys/:id/usage',
    {
      schema: {
        operationId: 'keyUsage',
        tags: ['usage'],
        params: KeyParams,
        response: { 200: KeyUsage, 400: failure('bad_request: a malformed id'), 404: failure('key_not_found') },
      },
    },
    async (request) => {
      const consumer = await parts.find.key(request.params.id);
      if (!consumer) throw new GatewayError('key_not_found', `No key with id "${request.params.id}"`);
      return { id: consumer.id, revoked: consumer.revoked, ...(await usageOf(consumer, parts)) };
    },
  );

  app.get(
    '/admin/accounts/:account/usage',
    {
      schema: {
        operationId: 'accountUsage',
        tags: ['usage'],
        params: AccountParams,
        response: {
          200: AccountUsage,
          400: failure('bad_request: a malformed account name'),
          404: failure('key_not_found: no key in that account'),
        },
      },
    },
    async (request) => {
      const members = await parts.find.account(request.params.account);
      if (members.length === 0) throw new GatewayError('key_not_found', `No key in account "${request.params.account}"`);
      return { keys: members.map((c) => c.id).sort(), ...(await usageOf(members[0]!, parts)) };
    },
  );

  // A ban is an account's, like its quota: lifting it is a call on the account.
  app.post(
    '/admin/accounts/:account/unban',
    {
      schema: {
        operationId: 'unbanAccount',
        tags: ['usage'],
        description: "Lifts the account's ban and forgets its recent 429s, so its next request is decided afresh.",
        params: AccountParams,
        response: {
          200: Unbanned,
          400: failure('bad_request: a malformed account name'),
          404: failure('key_not_found: no key in that account'),
          503: failure('quota_store_unavailable: Redis did not confirm the unban; ask again'),
        },
      },
    },
    async (request) => {
      const [member] = await parts.find.account(request.params.account);
      if (!member) throw new GatewayError('key_not_found', `No key in account "${request.params.account}"`);
      const lifted = await parts.store.unban(member.subject).catch((err: Error) => {
        request.log.warn({ account: request.params.account, cause: err.message }, 'unban: the quota store did not answer');
        throw new GatewayError(
          'quota_store_unavailable',
          'The quota store did not confirm the unban; ask again (lifting a ban twice is harmless)',
        );
      });
      return { account: request.params.account, lifted };
    },
  );
};

/** An account's usage statement for a billing period (usage/statements.ts). */
export const statementRoutes: FastifyPluginAsyncTypebox<UsageParts> = async (app, parts) => {
  app.get(
    '/admin/accounts/:account/statements/:period',
    {
      schema: {
        operationId: 'accountStatement',
        tags: ['usage'],
        description:
          "The account's usage statement for a billing period: what the usage export delivered for it, per plan and route, with refunds, credits, totals and their digest (docs/operators.md, Statements). `period`: current, previous, or a UTC date (YYYY-MM-DD) inside it.",
        params: Type.Object({ account: AccountParams.properties.account, period: Type.String({ maxLength: 64 }) }),
        response: {
          200: StatementSchema,
          400: failure('bad_request: a malformed account name or period'),
          404: failure('key_not_found: no key in that account'),
          409: failure('statements_not_enabled: the gateway exports no usage'),
          503: failure('quota_store_unavailable: Redis did not answer'),
        },
      },
    },
    async (request) => {
      const [member] = await parts.find.account(request.params.account);
      if (!member) throw new GatewayError('key_not_found', `No key in account "${request.params.account}"`);
      return accountStatement(parts.statements, parts.config(), member, request.params.period);
    },
  );
};

/** The alert webhooks' deliveries, on the admin port. */
export const alertRoutes: FastifyPluginAsyncTypebox<{ deliveries?: () => Promise<Delivery[]> }> = async (app, parts) => {
  app.get(
    '/admin/alerts/deliveries',
    {
      schema: {
        operationId: 'alertDeliveries',
        tags: ['usage'],
        description: 'The last 100 alert webhook attempts, newest first: a failed one is tried again with backoff.',
        response: { 200: Deliveries },
      },
    },
    async () => ({ deliveries: parts.deliveries ? await parts.deliveries() : [] }),
  );
};
