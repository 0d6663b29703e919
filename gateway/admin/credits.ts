import type { FastifyPluginAsyncTypebox } from '@fastify/type-provider-typebox';
import { Type } from '@sinclair/typebox';
import type { Consumer } from '../config/config.js';
import { GatewayError } from '../errors.js';
import type { KeyFinder } from '../auth/key-finder.js';
import { type AccountBook, type LedgerEntry, TopUpNotReplicated } from '../quota/store.js';
import { CreditFields } from '../quota/usage-view.js';
import { AccountParams, failure } from './schemas.js';

// An account's prepaid credits on the admin port: its balance and ledger, and top-ups, each
// applied once per Idempotency-Key however the retries race (topup.lua, one script).

const Instant = Type.String({ format: 'date-time' });

const Entry = Type.Object(
  {
    id: Type.String({ description: 'The ledger entry id (a Redis stream id: time, then sequence)' }),
    at: Instant,
    kind: Type.Union([Type.Literal('grant'), Type.Literal('topup'), Type.Literal('lapsed')], {
      description: 'lapsed: a credit lease its gateway instance never closed (it died), given back whole once it lapsed',
    }),
    amount: Type.Integer({ description: 'Units added' }),
    balance: Type.Integer({ description: 'The balance right after it' }),
    periods: Type.Optional(Type.Integer({ description: 'A grant: the periods it covers (more than 1 after idle periods, with rollover)' })),
    expired: Type.Optional(Type.Integer({ description: 'A grant without rollover: what was left of the last grant, which it replaced' })),
    reason: Type.Optional(Type.String()),
    idempotencyKey: Type.Optional(Type.String()),
  },
  { title: 'LedgerEntry' },
);

const Credits = Type.Object(
  {
    account: Type.String(),
    ...CreditFields,
    ledger: Type.Array(Entry, {
      description:
        'The last grants and top-ups (about 1,000), oldest first; with usage export on, every entry also goes to the sink as a CloudEvent',
    }),
  },
  { title: 'Credits', description: "The account's credits (with the grants due applied) and their ledger" },
);

const TopUpBody = Type.Object(
  {
    amount: Type.Integer({ minimum: 1, maximum: 1_000_000_000_000, description: 'Units to add (purchased: they never expire)' }),
    reason: Type.String({ minLength: 1, maxLength: 500, description: 'Kept in the ledger (an invoice number, a note)' }),
  },
  { title: 'TopUp', additionalProperties: false },
);

const TopUpHeaders = Type.Object({
  'idempotency-key': Type.String({
    minLength: 1,
    maxLength: 255,
    pattern: '^[\\x21-\\x7e]+$',
    description: 'Unique per top-up (a UUID): a retry with the same key adds nothing and answers as the first did',
  }),
});

const ToppedUp = Type.Object(
  {
    account: Type.String(),
    entryId: Type.String(),
    amount: Type.Integer(),
    balance: Type.Integer({ description: 'The balance right after this top-up' }),
    replayed: Type.Boolean({ description: 'True for a retry: nothing was added now' }),
  },
  { title: 'ToppedUp' },
);

const asEntry = (e: LedgerEntry) => {
  const { atMs, ...rest } = e;
  return { ...rest, at: new Date(atMs).toISOString() };
};

const notFound = failure('key_not_found: no key in that account');
const notEnabled = failure("credits_not_enabled: the account's plan and settings give it no credits");
const unavailable = failure('quota_store_unavailable: Redis did not answer; ask again (a top-up retried with its key is applied once)');

/** What the credit routes read and write: the account book, and accounts by name. */
export interface CreditParts {
  store: AccountBook;
  find: KeyFinder;
  /** Told of each top-up's balance (the subject's name, Redis's time of its ledger entry): the operator page's outstanding credit. */
  balanceSeen?: (name: string, atMs: number, balance: number) => Promise<void>;
}

export const creditRoutes: FastifyPluginAsyncTypebox<CreditParts> = async (app, parts) => {
  /** The account's first key, if it has credits: the subject whose credits these are. */
  const creditsOf = async (account: string): Promise<Consumer> => {
    const [member] = await parts.find.account(account);
    if (!member) throw new GatewayError('key_not_found', `No key in account "${account}"`);
    if (!member.subject.billing.credits) {
      throw new GatewayError('credits_not_enabled', `Account "${account}" has no credits: give its plan or its accounts entry credits`);
    }
    return member;
  };
  const fromStore = <T>(work: Promise<T>, what: string): Promise<T> =>
    work.catch((err: Error) => {
      if (err instanceof TopUpNotReplicated) {
        app.log.warn({ cause: err.message }, `${what}: not acknowledged`);
        throw new GatewayError(
          'quota_store_unavailable',
          `The top-up is recorded but not yet held by enough replicas (${err.replicas} of ${err.wanted}); send it again with the same Idempotency-Key: it is not added twice`,
        );
      }
      app.log.warn({ cause: err.message }, `${what}: the quota store did not answer`);
      throw new GatewayError('quota_store_unavailable', `The quota store did not answer; ask again`);
    });

  app.get(
    '/admin/accounts/:account/credits',
    {
      schema: {
        operationId: 'accountCredits',
        tags: ['credits'],
        params: AccountParams,
        response: { 200: Credits, 400: failure('bad_request: a malformed account name'), 404: notFound, 409: notEnabled, 503: unavailable },
      },
    },
    async (request) => {
      const { subject } = await creditsOf(request.params.account);
      const [usage, ledger] = await fromStore(Promise.all([parts.store.peek(subject), parts.store.ledger(subject)]), 'credits');
      // Read while Redis fails: the store knows no balance, and 0 would be a wrong answer.
      if (!usage.credits) throw new GatewayError('quota_store_unavailable', 'The quota store did not answer; ask again');
      const { granted, purchased, reserved = 0 } = usage.credits;
      return { account: request.params.account, balance: granted + purchased, granted, purchased, reserved, ledger: ledger.map(asEntry) };
    },
  );

  app.post(
    '/admin/accounts/:account/credits',
    {
      schema: {
        operationId: 'topUpCredits',
        tags: ['credits'],
        description:
          'Adds purchased credits, once per Idempotency-Key: a retry, even one racing the first, adds nothing and answers 200 with `replayed: true`.',
        params: AccountParams,
        headers: TopUpHeaders,
        body: TopUpBody,
        response: {
          200: ToppedUp,
          201: ToppedUp,
          400: failure('bad_request: a malformed account, body or Idempotency-Key'),
          404: notFound,
          409: notEnabled,
          422: failure('idempotency_key_reused: the key was used for a top-up of another amount or reason'),
          503: unavailable,
        },
      },
    },
    async (request, reply) => {
      const { account } = request.params;
      const { subject } = await creditsOf(account);
      const idempotencyKey = request.headers['idempotency-key'];
      const done = await fromStore(parts.store.topUp(subject, { ...request.body, idempotencyKey }), 'top-up');
      if (done.conflict) {
        throw new GatewayError('idempotency_key_reused', 'This Idempotency-Key was used for a top-up of another amount or reason');
      }
      if (done.replayed) reply.header('idempotent-replayed', 'true');
      else await parts.balanceSeen?.(subject.name, Number.parseInt(done.entryId, 10), done.balance).catch(() => undefined); // a page's figure: nothing billed
      reply.code(done.replayed ? 200 : 201);
      return { account, entryId: done.entryId, amount: request.body.amount, balance: done.balance, replayed: done.replayed };
    },
  );
};
