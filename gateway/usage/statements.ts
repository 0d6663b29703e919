import type { Consumer, GatewayConfig } from '../config/config.js';
import { GatewayError } from '../errors.js';
import { billingPeriod, type Period } from '../quota/period.js';
import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';
import { DIGEST, statementOf } from './periods.js';
import { pricesAt, redisNow } from './closes.js';
import { type PricedStatement, priced, pricesFor } from './prices.js';
import { Type } from '@sinclair/typebox';

// A usage statement per billing period (issue 49): GET /v1/me/statements/{period} and
// GET /admin/accounts/{account}/statements/{period}, read from the figures the export tallied
// as the sink accepted each event (periods.ts): one HGETALL, whatever the traffic.

export interface AccountStatement extends PricedStatement {
  account: string;
  billingDay: number;
  /** The plan's units a period (perMonth), where it has one: what the overage counts past. */
  included: number | null;
}

const Int = (description?: string) => Type.Integer(description ? { description } : {});
const Iso = Type.String({ format: 'date-time' });
/** An exact decimal (usage/prices.ts), as a string so no float rounds it. */
const Money = Type.String({ pattern: '^-?[0-9]+([.][0-9]+)?$' });
/** The answer's shape, for both ports' documents and the admin port's serializer. */
export const StatementSchema = Type.Object(
  {
    account: Type.String(),
    billingDay: Type.Integer({ minimum: 1, maximum: 31 }),
    included: Type.Union([Type.Integer(), Type.Null()], { description: "The plan's units a period (perMonth); null: it has no month" }),
    period: Type.Object({ start: Iso, end: Iso }),
    status: Type.Union([Type.Literal('open'), Type.Literal('closing'), Type.Literal('closed')], {
      description: 'open: events still come; closing: frozen, its close event not yet taken by the sink; closed',
    }),
    closedAt: Type.Union([Iso, Type.Null()]),
    currency: Type.Union([Type.String({ pattern: '^[A-Z]{3}$' }), Type.Null()], {
      description: "The plans' currency (ISO 4217); null: no plan of the statement's lines has prices",
    }),
    lines: Type.Array(
      Type.Object({
        plan: Type.String(),
        route: Type.String(),
        requests: Int(),
        refunds: Int('Refund events (the backend failed the request)'),
        units: Int('Net of refunds'),
        included: Int('Units within the quota: units less overage'),
        overage: Int('Units past the quota, net of refunds'),
        price: Type.Union([Type.Object({ unit: Money, overage: Money }), Type.Null()], {
          description:
            "The plan's prices a unit, within the quota and past it (config: plans.<plan>.prices, as they were at the period's end for a period that ended); null: none set",
        }),
        amount: Type.Union([Money, Type.Null()], { description: 'included x unit + overage x overage price, exact (not rounded)' }),
      }),
      { description: 'Per plan and route: the requests exported for the period and their refunds, units and overage' },
    ),
    totals: Type.Object({
      requests: Int(),
      units: Int("Net of refunds: what a SUM of the exported events' units gives for the period"),
      refunds: Type.Object({ events: Int(), units: Int() }),
      overage: Int('Net of refunds'),
      corrections: Int('Events of an earlier, closed period that came after its close, counted here'),
      amount: Type.Union([Money, Type.Null()], { description: "The lines' amounts summed; null: no line has a price" }),
    }),
    credits: Type.Object(
      {
        granted: Int('Credits granted in the period'),
        purchased: Int('Credits bought in the period (top-ups)'),
        applied: Type.Object(
          { granted: Int('From the grant, which is spent first'), purchased: Int('From purchased credits') },
          { description: "Credits the period's requests spent, by where they came from" },
        ),
        returned: Int("Credits the period's refunds gave back, as purchased credits (they never expire)"),
      },
      {
        description: 'Prepaid credits: granted, bought, spent (applied) and given back in the period; zeros for an account without credits',
      },
    ),
    events: Int('Request and refund events exported for the period'),
    digest: Type.Object(
      { algorithm: Type.Literal(DIGEST), value: Type.String({ pattern: '^[0-9a-f]{64}$' }) },
      { description: 'The sum, mod 2^256, of SHA-256("<event id> <units>") over those events: the sink can compute it from what it holds' },
    ),
  },
  { title: 'Statement' },
);

const DATE = /^(\d{4})-(\d{2})-(\d{2})$/;

/** `current`, `previous`, or a UTC date (YYYY-MM-DD) inside the period: the period, or why not. */
export function periodOf(param: string, nowMs: number, billingDay: number): Period | GatewayError {
  const now = billingPeriod(nowMs, billingDay);
  if (param === 'current') return now;
  if (param === 'previous') return billingPeriod(now.startMs - 1, billingDay);
  const m = DATE.exec(param);
  const ms = m ? Date.UTC(Number(m[1]), Number(m[2]) - 1, Number(m[3])) : Number.NaN;
  if (!m || new Date(ms).toISOString().slice(0, 10) !== param) {
    return new GatewayError(
      'bad_request',
      `The period "${param.slice(0, 40)}" is not one: give current, previous, or a date (YYYY-MM-DD, UTC) inside the billing period`,
    );
  }
  return billingPeriod(ms, billingDay);
}

/**
 * The statement of `consumer`'s account for `param`'s period (`current` and `previous` by Redis's
 * clock, as the events are stamped). Without a usage export there is nothing tallied: 409
 * statements_not_enabled; Redis not answering: 503.
 */
export async function accountStatement(
  redis: RedisClient | undefined,
  config: GatewayConfig,
  consumer: Consumer,
  param: string,
): Promise<AccountStatement> {
  const { billingDay } = consumer.subject.billing;
  const checked = periodOf(param, Date.now(), billingDay);
  if (checked instanceof GatewayError) throw checked;
  if (!redis || !config.usageExport) {
    throw new GatewayError(
      'statements_not_enabled',
      'Statements are tallied from the usage export: this gateway exports none (usage.export in its config, with Redis)',
    );
  }
  const nowMs = await redisNow(redis).catch(() => {
    throw new GatewayError('quota_store_unavailable', 'The quota store did not answer; ask again');
  });
  const period = periodOf(param, nowMs, billingDay) as Period;
  // A period that ended is priced as it was at its end (closes.ts, pricesAt); the open one by the config's prices.
  const [hash, kept] = await Promise.all([
    redis.hgetall(subjectKey.statements(consumer.subject.name)),
    period.endMs <= nowMs ? pricesAt(redis, config.redisPrefix, period.endMs) : undefined,
  ]).catch(() => {
    throw new GatewayError('quota_store_unavailable', 'The quota store did not answer; ask again');
  });
  return {
    account: consumer.account,
    billingDay,
    // The quota the overage counts past: the month's limit less what overage admits (config.ts, ceilings).
    included: consumer.subject.limits.perMonth ? consumer.subject.limits.perMonth - consumer.subject.billing.overage : null,
    ...priced(statementOf(hash, period), pricesFor(kept, config.plans)),
  };
}
