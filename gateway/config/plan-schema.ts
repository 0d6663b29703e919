import { type TOptional, Type } from '@sinclair/typebox';
import { shortFields } from './short.js';
import { type LimitField, type RequiredLimit, WINDOWS } from '../quota/windows.js';

// The config file's parts that a plan, a key and an account are made of: limits, credits, costs,
// prices, alert thresholds. config.ts puts them together into the whole file's schema.

export const Count = Type.Integer({ minimum: 1 });
/** Decimals a price may have (a millionth of a cent and finer): usage/prices.ts computes at this scale. */
export const PRICE_DECIMALS = 9;
/** Quoted in YAML: `"0.002"` (a bare 0.002 is a float, and a message says to quote it). */
const Price = Type.String({
  pattern: `^(0|[1-9][0-9]{0,8})([.][0-9]{1,${PRICE_DECIMALS}})?$`,
  hint: 'a price is a decimal in quotes, as "0.002" (unquoted, YAML reads a float)',
});
type CountSchema = typeof Count;
/** The limits' fields, one per window (quota/windows.ts), required where the row says a plan must give it. */
export const limitFields = () =>
  Object.fromEntries(
    WINDOWS.map((w) => [w.limit, w.inPlans === 'required' ? Count : Type.Optional(Type.Integer({ minimum: 1, description: w.describe }))]),
  ) as { [K in RequiredLimit]: CountSchema } & { [K in Exclude<LimitField, RequiredLimit>]: TOptional<CountSchema> };
/** The same fields, every one optional: a plan gives them all, or (custom) none. */
export const optionalLimitFields = () =>
  Object.fromEntries(WINDOWS.map((w) => [w.limit, Type.Optional(Type.Integer({ minimum: 1, description: w.describe }))])) as {
    [K in LimitField]: TOptional<CountSchema>;
  };
/** A key's own limits (a custom plan's, or over its plan's). */
export const LimitsSchema = Type.Object({ ...limitFields(), ...shortFields() }, { additionalProperties: false });
/** A key's own windows' limits; its short policies (shortFields) may travel beside them. */
export type KeyLimits = { [K in RequiredLimit]: number } & { [K in Exclude<LimitField, RequiredLimit>]?: number };
/** Prepaid credits: `grant` units each billing period, added to what is left with `rollover` (else in place of it). */
export const CreditsSchema = Type.Object(
  { grant: Type.Integer({ minimum: 0 }), every: Type.Literal('month'), rollover: Type.Optional(Type.Boolean()) },
  { additionalProperties: false },
);
export const AccountName = Type.String({ pattern: '^[a-z0-9_-]{1,64}$' });
/** Fractions of a window (day, billing period) or of the credits granted, each firing a webhook once per period. */
export const Thresholds = Type.Array(Type.Number({ exclusiveMinimum: 0, maximum: 1 }), { minItems: 1, maxItems: 10, uniqueItems: true });
/** An account's own settings (`accounts.<name>`): the day its billing month starts, and credits over its plan's. */
export const AccountSchema = Type.Object(
  { billingDay: Type.Optional(Type.Integer({ minimum: 1, maximum: 31 })), credits: Type.Optional(CreditsSchema) },
  { additionalProperties: false },
);
/** Units a request of a route costs, by `"METHOD /path"` (default 1). */
export const Costs = Type.Record(Type.String(), Type.Integer({ minimum: 1, maximum: 1_000_000 }));
export const IsoDate = Type.String({ pattern: '^\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}(:\\d{2}(\\.\\d+)?)?(Z|[+-]\\d{2}:\\d{2})$' });

/** A plan (`plans.<name>`): its limits and short policies, or `custom` for keys that bring their own. */
export const PlanSchema = Type.Object(
  {
    ...optionalLimitFields(),
    ...shortFields(),
    /** Units admitted past the month's quota (the day's, without perMonth), billed extra. */
    overage: Type.Optional(Type.Object({ upTo: Count }, { additionalProperties: false })),
    credits: Type.Optional(CreditsSchema),
    /** Its own alert thresholds, over the `alerts:` section's. */
    alerts: Type.Optional(Type.Object({ thresholds: Thresholds }, { additionalProperties: false })),
    custom: Type.Optional(Type.Boolean()),
    costs: Type.Optional(Costs),
    /** A unit's price within the quota and past it, for the statements (usage/prices.ts): `"0.002"`. */
    prices: Type.Optional(
      Type.Object(
        { currency: Type.String({ pattern: '^[A-Z]{3}$' }), unit: Type.Optional(Price), overage: Type.Optional(Price) },
        { additionalProperties: false },
      ),
    ),
    /** false: shadow mode, counted and reported as if enforced but never refused for quota. */
    enforce: Type.Optional(Type.Boolean()),
  },
  { additionalProperties: false },
);
