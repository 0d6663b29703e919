import { type Static, Type } from '@sinclair/typebox';

// `usage.export` of the config file: where usage events go and in which biller's shape (issue 49).

/** Stripe's and Lago's: at most this many events a request, whatever `batchSize` says. */
export const BILLER_BATCH = 100;

const Name = Type.String({ minLength: 1, maxLength: 100, pattern: '^[^\\s]+$' });

export const UsageExportSchema = Type.Object(
  {
    url: Type.String({ pattern: '^https?://[^\\s]+$' }),
    /** Events kept per account while the sink lags; older ones are dropped (counted and logged). */
    maxEvents: Type.Integer({ minimum: 1000, maximum: 100_000_000, default: 1_000_000 }),
    batchSize: Type.Integer({ minimum: 1, maximum: 5000, default: 500 }),
    /**
     * `cloudevents` (unset); `openmeter`: a refund is a request event with negative units, so one SUM meter on the
     * request type nets it; `stripe`: Stripe's v2 meter event stream; `lago`: Lago's `/api/v1/events/batch`.
     */
    format: Type.Optional(
      Type.Union([Type.Literal('cloudevents'), Type.Literal('openmeter'), Type.Literal('stripe'), Type.Literal('lago')]),
    ),
    /** Sent on every POST; `${NAME}` filled from the environment (env-template.ts), e.g. `Authorization: Bearer ${OPENMETER_TOKEN}`. */
    headers: Type.Optional(Type.Record(Type.String({ pattern: "^[A-Za-z0-9!#$%&'*+.^_`|~-]+$" }), Type.String({ maxLength: 4096 }))),
    /** Account → the biller's customer (Stripe: `cus_…`) or subscription (Lago: its `external_id`). */
    customers: Type.Optional(Type.Record(Type.String({ pattern: '^[a-z0-9_-]{1,64}$' }), Name)),
    /**
     * `eventName`: the meter's `event_name` on Stripe's side. `secretKey`: a `${NAME}` filled from the environment; with
     * it the export thread makes and renews the stream's meter event session itself (stripe-session.ts).
     */
    stripe: Type.Optional(
      Type.Object(
        {
          eventName: Type.Optional(Name),
          secretKey: Type.Optional(Type.String({ maxLength: 200 })),
          sessionUrl: Type.Optional(Type.String({ pattern: '^https?://[^\\s]+$' })),
        },
        { additionalProperties: false },
      ),
    ),
    /** The billable metric's `code` on Lago's side. */
    lago: Type.Optional(Type.Object({ code: Type.Optional(Name) }, { additionalProperties: false })),
  },
  { additionalProperties: false },
);

export type UsageExport = Omit<Static<typeof UsageExportSchema>, 'headers'> & {
  /** As written: `${NAME}` still unfilled (the export thread fills it). */
  headers?: Readonly<Record<string, string>>;
};
export type ExportFormat = NonNullable<UsageExport['format']>;

/** Where a meter event session is made (Stripe's API reference, v2 Billing: Meter Event Streams). */
export const STRIPE_SESSION_URL = 'https://api.stripe.com/v2/billing/meter_event_session';

/** A format's events a POST may carry: the configured batch, capped by the biller's limit. */
export const batchLimit = (target: UsageExport) =>
  target.format === 'stripe' || target.format === 'lago' ? Math.min(target.batchSize, BILLER_BATCH) : target.batchSize;

/** What the schema cannot say: a biller's format needs its customers, and a biller's section goes with its format. */
export function exportProblems(target: UsageExport | undefined): string[] {
  if (!target) return [];
  const problems: string[] = [];
  const biller = target.format === 'stripe' || target.format === 'lago';
  if (biller && target.customers === undefined)
    problems.push(`usage.export.customers: required with format ${target.format} (account → its ${target.format} customer)`);
  if (!biller && target.customers !== undefined) problems.push('usage.export.customers: only with format stripe or lago');
  if (target.stripe?.sessionUrl !== undefined && target.stripe.secretKey === undefined)
    problems.push('usage.export.stripe.sessionUrl: only with usage.export.stripe.secretKey');
  const own = Object.keys(target.headers ?? {}).find((h) => h.toLowerCase() === 'authorization');
  if (target.stripe?.secretKey !== undefined && own !== undefined)
    problems.push(`usage.export.headers.${own}: set from the meter event session when usage.export.stripe.secretKey is set`);
  for (const section of ['stripe', 'lago'] as const)
    if (target[section] !== undefined && target.format !== section) problems.push(`usage.export.${section}: only with format ${section}`);
  return problems;
}
