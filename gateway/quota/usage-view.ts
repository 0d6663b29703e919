import { type Static, type TInteger, type TOptional, Type } from '@sinclair/typebox';
import { overageWindow, type QuotaSubject, softQuota, windows, type WindowState } from './decision.js';
import type { Usage } from './store.js';
import { type LimitField, type RequiredLimit, WINDOWS, type WindowName } from './windows.js';

// An account's quota as a reader sees it: the consumer's own GET /v1/me/usage and the admin
// usage lookups show the same view, from the store the gateway enforces with. Its schema is
// the one source of both OpenAPI documents' description of it.

const Instant = Type.String({ format: 'date-time' });
const Window = Type.Object({
  limit: Type.Integer({ description: 'Units the window admits before refusing (with overage: its quota plus the overage)' }),
  used: Type.Integer({ description: 'Units admitted in it so far' }),
  remaining: Type.Integer({ minimum: 0 }),
  resetAt: Type.String({ format: 'date-time', description: 'When it starts again (UTC-aligned; the month at the billing day)' }),
});

/** A limit per window (windows.ts): those every plan gives, and the optional ones where set. */
const limitFields = () =>
  Object.fromEntries(WINDOWS.map((w) => [w.limit, w.inPlans === 'required' ? Type.Integer() : Type.Optional(Type.Integer())])) as {
    [K in RequiredLimit]: TInteger;
  } & { [K in Exclude<LimitField, RequiredLimit>]: TOptional<TInteger> };
/** A window's state per window the subject has: the minute always. */
const windowFields = () =>
  Object.fromEntries(WINDOWS.map((w) => [w.name, w.always ? Window : Type.Optional(Window)])) as { minute: typeof Window } & {
    [K in Exclude<WindowName, 'minute'>]: TOptional<typeof Window>;
  };

/** An account's credits as every view shows them: the usage views and the admin credits view. */
export const CreditFields = {
  balance: Type.Integer({ description: 'Units left: granted plus purchased' }),
  granted: Type.Integer({
    description: "Left of this period's grant (spent first; expires at the period's end unless it rolls over)",
  }),
  purchased: Type.Integer({ description: 'Left of top-ups (spent after the grant; never expire)' }),
  reserved: Type.Integer({
    description:
      'Held by leases gateway instances hold (not in `balance`): spent as they deliver, the rest back when each lease closes or lapses (within a minute)',
  }),
};

export const UsageView = Type.Object(
  {
    account: Type.String(),
    plan: Type.String(),
    limits: Type.Object(limitFields(), { description: 'The quotas sold (without overage)' }),
    enforced: Type.Boolean({ description: 'False in shadow mode: refusals are counted and reported, not made' }),
    windows: Type.Object(windowFields()),
    period: Type.Optional(
      Type.Object(
        { start: Instant, end: Instant, billingDay: Type.Integer({ minimum: 1, maximum: 31 }) },
        { description: 'The billing period: a month from the billing day, 00:00 UTC' },
      ),
    ),
    overage: Type.Optional(
      Type.Object(
        {
          window: Type.Union([Type.Literal('month'), Type.Literal('day')]),
          quota: Type.Integer({ description: 'Units included in the plan' }),
          upTo: Type.Integer({ description: 'Units admitted past the quota' }),
          used: Type.Integer({ description: 'Units admitted past the quota so far in this window: billed extra' }),
        },
        { description: 'Units past the quota, admitted and billed extra' },
      ),
    ),
    credits: Type.Optional(
      Type.Object(
        {
          ...CreditFields,
          grant: Type.Integer({ description: 'Units granted at each period start' }),
          rollover: Type.Boolean(),
          nextGrantAt: Type.Union([Instant, Type.Null()], { description: 'When the next grant comes; null when none is due' }),
        },
        { description: 'Prepaid credits: every admitted unit is paid from them; none left answers 402' },
      ),
    ),
    concurrency: Type.Optional(
      Type.Object(
        {
          limit: Type.Integer({ description: 'Requests in flight at once' }),
          inFlight: Type.Integer({ minimum: 0, description: "The account's requests in flight now, across every instance" }),
        },
        { description: 'In-flight requests: past the limit, 429 concurrency_limit_exceeded' },
      ),
    ),
    burst: Type.Optional(
      Type.Object(
        {
          size: Type.Integer({ description: 'Requests admitted at once from full' }),
          perSecond: Type.Number({ description: 'Refill rate' }),
          remaining: Type.Integer({ minimum: 0, description: 'Requests admitted now before refusing' }),
        },
        { description: 'Burst (GCRA): past it, 429 burst_limit_exceeded' },
      ),
    ),
    ban: Type.Object({ active: Type.Boolean(), until: Type.Union([Instant, Type.Null()]) }),
    recentRejections: Type.Integer({ description: '429s within the ban window so far: a ban follows past the limit' }),
    at: Type.String({ format: 'date-time', description: "The quota store's time of this reading" }),
  },
  { description: "The account's quota as the gateway holds it: the keys of one account share it" },
);
export type UsageView = Static<typeof UsageView>;

const iso = (ms: number) => new Date(ms).toISOString();
const view = (w: WindowState) => ({ limit: w.limit, used: w.used, remaining: Math.max(0, w.limit - w.used), resetAt: iso(w.resetMs) });

/** Who is asking about which quota: a key's consumer, as config.ts compiles it. */
interface Reader {
  account: string;
  plan: string;
  subject: QuotaSubject;
}

export function usageView({ account, plan, subject }: Reader, usage: Usage): UsageView {
  const { limits, billing } = subject;
  const list = windows(limits, usage.nowMs, usage, usage.period);
  const byName = Object.fromEntries(list.map((w) => [w.name, view(w)])) as UsageView['windows'];
  const soft = softQuota(subject);
  const long = overageWindow(limits);
  const quotas = {} as UsageView['limits'];
  for (const w of WINDOWS) if (w.inPlans === 'required' || limits[w.limit]) quotas[w.limit] = limits[w.limit] ?? 0;
  if (soft > 0) quotas[long === 'month' ? 'perMonth' : 'perDay'] = soft;
  const out: UsageView = {
    account,
    plan,
    limits: quotas,
    enforced: subject.enforce,
    windows: byName,
    ban: { active: usage.banUntilMs > 0, until: usage.banUntilMs > 0 ? iso(usage.banUntilMs) : null },
    recentRejections: usage.recentRejections,
    at: iso(usage.nowMs),
  };
  const short = subject.short;
  if (short?.concurrent) out.concurrency = { limit: short.concurrent, inFlight: usage.inFlight ?? 0 };
  if (short?.burst) out.burst = { ...short.burst, remaining: Math.max(0, usage.burstLeft ?? short.burst.size) };
  if (usage.period) out.period = { start: iso(usage.period.startMs), end: iso(usage.period.endMs), billingDay: billing.billingDay };
  if (soft > 0) {
    out.overage = { window: long, quota: soft, upTo: billing.overage, used: usage.overageUsed ?? 0 };
  }
  if (billing.credits && usage.credits) {
    const { granted, purchased, reserved = 0 } = usage.credits;
    const due = billing.credits.grant > 0 && usage.period;
    out.credits = {
      balance: granted + purchased,
      granted,
      purchased,
      reserved,
      grant: billing.credits.grant,
      rollover: billing.credits.rollover,
      nextGrantAt: due ? iso(usage.period!.endMs) : null,
    };
  }
  return out;
}
