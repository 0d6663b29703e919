import { UsageView } from '../quota/usage-view.js';
import { type Static, type TSchema, Type } from '@sinclair/typebox';
import { CreditsSchema, limitFields, optionalLimitFields } from '../config/config.js';
import { shortFields } from '../config/short.js';
import { ErrorBody } from '../errors.js';

// The admin port's request and response shapes: route validation, handler types and the
// admin OpenAPI document all come from these. Request bodies refuse unknown fields, so a
// misspelled one ("limit", "expires") is a 400 naming it, not a key made without it.

/** Key ids, account and plan names: the config file's own rule for them. */
const Name = Type.String({ pattern: '^[a-z0-9_-]{1,64}$' });
const Instant = Type.String({ format: 'date-time' });

export const KeyParams = Type.Object({ id: Type.String({ ...Name, description: 'The key id' }) });
export const AccountParams = Type.Object({ account: Type.String({ ...Name, description: 'The account name' }) });

/** The gateway's Error body, shared by id so the document holds it once (components/schemas/Error). */
export const SharedError = { ...ErrorBody, $id: 'Error' };

/** An error answer, described for one status: the codes it can carry and when. */
export const failure = (description: string) => Type.Unsafe<ErrorBody>({ $ref: SharedError.$id, description });

/** A 200/201 answer's schema with the description the document gives it. */
const described = <T extends TSchema>(schema: T, description: string): T => ({ ...schema, description });

export const Health = described(Type.Object({ status: Type.Literal('ok') }), 'The process is up');
export const Ready = described(
  Type.Object({
    status: Type.Literal('ready'),
    store: Type.Union([Type.Literal('redis'), Type.Literal('memory')]),
    warnings: Type.Optional(
      Type.Array(Type.String(), { description: 'What an operator should act on that does not stop traffic (keys Redis lost)' }),
    ),
  }),
  'Redis (if configured) and the backend answer',
);

const Limits = Type.Object(
  { ...limitFields(), ...shortFields() },
  { additionalProperties: false, description: "The key's own limits instead of its plan's" },
);

export const NewKey = Type.Object(
  {
    plan: Type.String({ ...Name, description: 'A plan of the config file' }),
    id: Type.Optional(Type.String({ ...Name, description: 'Default: the plan and 6 random hex digits' })),
    account: Type.Optional(Type.String({ ...Name, description: 'The account whose quota it shares; default: its own id' })),
    limits: Type.Optional(Limits),
    // No format here: the config validator checks the date, with the same message as the keys command.
    expiresAt: Type.Optional(Type.String({ description: 'When the key stops working, ISO 8601 (2030-01-01T00:00:00Z)' })),
  },
  { title: 'NewKey', additionalProperties: false },
);
export type NewKey = Static<typeof NewKey>;

export const Rotation = Type.Object(
  {
    // Its text is read by the keys command's own parser (auth/key-file.ts), which names it when it refuses.
    grace: Type.Optional(
      Type.String({ default: '24h', description: 'How long the old key keeps working: a number and a unit, as 90s, 15m, 24h or 7d' }),
    ),
  },
  { title: 'Rotation', additionalProperties: false },
);

const Key = Type.String({ pattern: '^psk_(live|test)_[A-Za-z0-9]{36}$', description: 'The key itself, shown only in this answer' });

export const IssuedKey = Type.Object(
  { id: Type.String(), key: Key, note: Type.String() },
  { title: 'IssuedKey', description: 'The key, shown only now' },
);

/** Where a change was made: a key in both the config file and the key registry is changed in both. */
const Stores = Type.Array(Type.String(), { description: 'The stores changed: the config file\'s path, "the key registry", or both' });

export const RotatedKey = Type.Object(
  { id: Type.String(), key: Key, account: Type.String(), plan: Type.String(), oldExpiresAt: Instant, stores: Stores },
  { title: 'RotatedKey', description: 'The new key, shown only now; the old one expires after the grace' },
);

export const Revoked = described(
  Type.Object({ id: Type.String(), revokedAt: Instant, stores: Stores }),
  'Revoked: the key answers 401 once the file is reloaded',
);

const KeyStatus = Type.Union([Type.Literal('active'), Type.Literal('expired'), Type.Literal('revoked')]);

const KeyRow = Type.Object(
  {
    id: Type.String(),
    account: Type.String(),
    plan: Type.String(),
    limits: Type.Object({ ...optionalLimitFields(), ...shortFields() }),
    status: KeyStatus,
    // As written in the file, where seconds may be left out: not always RFC 3339's date-time.
    createdAt: Type.Optional(Type.String()),
    expiresAt: Type.Optional(Type.String()),
    revokedAt: Type.Optional(Type.String()),
  },
  { title: 'KeyRow' },
);

const BillingDay = Type.Integer({
  minimum: 1,
  maximum: 31,
  description: 'The day of the month its billing month starts (00:00 UTC); default 1',
});
const Credits = { ...CreditsSchema, description: "Prepaid credits granted each billing month, in place of its plan's" };

export const AccountChange = Type.Object(
  {
    billingDay: Type.Optional(Type.Union([BillingDay, Type.Null()], { description: 'A day from 1 to 31; null removes it' })),
    credits: Type.Optional(Type.Union([Credits, Type.Null()], { description: "The account's credits; null removes them" })),
  },
  {
    title: 'AccountChange',
    additionalProperties: false,
    minProperties: 1,
    description: 'The settings to change: a field left out stays as it is',
  },
);

export const AccountSettings = Type.Object(
  { account: Type.String(), billingDay: Type.Optional(BillingDay), credits: Type.Optional(Credits) },
  { title: 'AccountSettings', description: "The account's settings as the config file now holds them" },
);

/** The list's page size: bounded, so a page costs the same at a million keys as at ten. */
export const PAGE_LIMIT = { default: 100, maximum: 1000 } as const;

export const KeyListQuery = Type.Object(
  {
    limit: Type.Optional(
      Type.Integer({ minimum: 1, maximum: PAGE_LIMIT.maximum, default: PAGE_LIMIT.default, description: 'Keys in a page at most' }),
    ),
    cursor: Type.Optional(Type.String({ minLength: 1, maxLength: 100, description: "The previous page's `next`: the page after it" })),
    account: Type.Optional(Type.String({ ...Name, description: "Only this account's keys" })),
    status: Type.Optional({ ...KeyStatus, description: 'Only keys in this state' }),
  },
  { additionalProperties: false },
);
export type KeyListQuery = Static<typeof KeyListQuery>;

export const KeyList = described(
  Type.Object({
    keys: Type.Array(KeyRow),
    next: Type.Optional(
      Type.String({
        description: 'There may be more: ask again with this as `cursor`. A page may hold fewer keys than `limit` and still have one',
      }),
    ),
  }),
  'A page of the keys in id order, never a secret or a digest',
);

/** An account's view (quota/usage-view.ts, as GET /v1/me/usage shows it) and which store it was read from. */
const Usage = Type.Composite([
  UsageView,
  Type.Object({
    store: Type.Union([Type.Literal('redis'), Type.Literal('memory'), Type.Literal('memory (Redis failing)')]),
    events: Type.Optional(
      Type.Object(
        {
          exported: Type.Integer({ description: 'Events (requests and refunds) the sink has taken' }),
          pending: Type.Integer({
            description: "Events waiting in the account's two streams: its events, and its leased admissions' bundles",
          }),
          dropped: Type.Integer({
            description: 'Events the cap (usage.export.maxEvents, held by each of the two streams) dropped before they were sent',
          }),
          rejected: Type.Integer({
            description: 'Events the sink refused for good (a 4xx), set aside with its reason so the events behind them went on',
          }),
          unsettled: Type.Integer({
            description:
              'Units counted in leases whose events are not written: still held by an instance (at most a lease and USAGE_BATCH_MS of events each), or lost with one that died',
          }),
        },
        {
          description:
            'Usage export, reconciled: every event written is exported, pending, dropped or rejected; every unit counted is in an event written or unsettled',
        },
      ),
    ),
  }),
]);
export type Usage = Static<typeof Usage>;

export const KeyUsage = Type.Composite([Type.Object({ id: Type.String(), revoked: Type.Boolean() }), Usage], {
  title: 'KeyUsage',
  description: "The key's account's usage: the keys of one account share one quota",
});

export const AccountUsage = Type.Composite([Type.Object({ keys: Type.Array(Type.String()) }), Usage], {
  title: 'AccountUsage',
  description: 'The account and its keys',
});

export const Unbanned = described(
  Type.Object({
    account: Type.String(),
    lifted: Type.Boolean({ description: 'False when no ban was in force (its recent 429s are forgotten all the same)' }),
  }),
  'The ban is lifted; every instance sees it within a second',
);

export const Deliveries = described(
  Type.Object({
    deliveries: Type.Array(
      Type.Object({
        id: Type.String({ description: 'The webhook-id: the same on every attempt' }),
        type: Type.String(),
        account: Type.String(),
        status: Type.Union([Type.Integer(), Type.Null()], { description: "The receiver's status; null when it could not be reached" }),
        error: Type.Optional(Type.String()),
        at: Instant,
      }),
    ),
  }),
  'The last alert webhook attempts, newest first',
);
