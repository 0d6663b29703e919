import { describe, expect, it } from 'vitest';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { rateLimitHeaders } from '../../gateway/quota/headers.js';
import { MemoryQuotaStore } from '../../gateway/quota/memory-store.js';
import { billingPeriod, periodsBetween } from '../../gateway/quota/period.js';
import { policyHeader } from '../../gateway/quota/headers.js';

// The billing period's calendar and the in-process store's month, credits and overage, on a
// fake clock: what quota.lua does in Redis, step for step (integration/billing.test.ts holds billing.lua's calendar to period.ts).

const utc = (y: number, m: number, d: number, h = 0, min = 0, s = 0, ms = 0) => Date.UTC(y, m - 1, d, h, min, s, ms);

describe('the billing period', () => {
  it('starts on the billing day at 00:00 UTC, and on the last day of a month too short for it', () => {
    // billingDay 31: January 31, February 28 (29 in a leap year), March 31, April 30, May 31.
    expect(billingPeriod(utc(2027, 2, 10), 31)).toEqual({ startMs: utc(2027, 1, 31), endMs: utc(2027, 2, 28) });
    expect(billingPeriod(utc(2027, 2, 28), 31)).toEqual({ startMs: utc(2027, 2, 28), endMs: utc(2027, 3, 31) });
    expect(billingPeriod(utc(2028, 2, 28, 23, 59, 59, 999), 31)).toEqual({ startMs: utc(2028, 1, 31), endMs: utc(2028, 2, 29) });
    expect(billingPeriod(utc(2028, 2, 29), 31)).toEqual({ startMs: utc(2028, 2, 29), endMs: utc(2028, 3, 31) });
    expect(billingPeriod(utc(2027, 4, 29), 31)).toEqual({ startMs: utc(2027, 3, 31), endMs: utc(2027, 4, 30) });
    expect(billingPeriod(utc(2027, 4, 30), 31)).toEqual({ startMs: utc(2027, 4, 30), endMs: utc(2027, 5, 31) });
    expect(billingPeriod(utc(2027, 5, 30, 12), 31)).toEqual({ startMs: utc(2027, 4, 30), endMs: utc(2027, 5, 31) });
  });

  it('runs from the billing day to the next across the year, 1 ms before the start belonging to the period before', () => {
    expect(billingPeriod(utc(2026, 12, 31, 23), 1)).toEqual({ startMs: utc(2026, 12, 1), endMs: utc(2027, 1, 1) });
    expect(billingPeriod(utc(2027, 1, 15) - 1, 15)).toEqual({ startMs: utc(2026, 12, 15), endMs: utc(2027, 1, 15) });
    expect(billingPeriod(utc(2027, 1, 15), 15)).toEqual({ startMs: utc(2027, 1, 15), endMs: utc(2027, 2, 15) });
  });

  it('counts the periods between two starts by their months', () => {
    expect(periodsBetween(utc(2027, 1, 31), utc(2027, 2, 28))).toBe(1);
    expect(periodsBetween(utc(2026, 11, 30), utc(2027, 3, 31))).toBe(4);
  });
});

const subject = (over: Partial<QuotaSubject> = {}): QuotaSubject => {
  const limits = { perMinute: 1000, perDay: 100_000, perMonth: 5 };
  return {
    name: `s${Math.random()}`,
    limits,
    bans: null,
    policy: policyHeader(limits),
    lasting: true,
    enforce: true,
    billing: { ...NO_BILLING, billingDay: 31 },
    events: 0,
    alerts: '',
    ...over,
  };
};

describe('the in-process store on a fake clock', () => {
  it('refuses past the month with monthly_quota_exceeded until the next period, then counts from zero', async () => {
    let now = utc(2027, 2, 27, 23, 59, 59);
    const store = new MemoryQuotaStore(() => now);
    const s = subject();
    for (let i = 0; i < 5; i++) expect((await store.consume(s)).outcome).toBe('allowed');
    const refused = await store.consume(s);
    expect(refused.outcome).toBe('month');
    // The period ends on February 28 (billingDay 31): Retry-After is until then.
    expect(rateLimitHeaders(refused, s.policy)['retry-after']).toBe(String((utc(2027, 2, 28) - now) / 1000));
    expect(rateLimitHeaders(refused, s.policy)['ratelimit-policy']).toBe(
      '"minute";q=1000;w=60, "day";q=100000;w=86400, "month";q=5;w=2419200', // 28 days
    );
    now = utc(2027, 2, 28);
    const next = await store.consume(s);
    expect(next.outcome).toBe('allowed');
    expect(next.windows[2]).toMatchObject({ name: 'month', used: 1, resetMs: utc(2027, 3, 31) });
  });

  it('grants credits at each period start, in place of what was left, or added to it with rollover', async () => {
    let now = utc(2027, 1, 10);
    const store = new MemoryQuotaStore(() => now);
    const plain = subject({
      limits: { perMinute: 1000, perDay: 100_000 },
      billing: { billingDay: 1, overage: 0, credits: { grant: 3, rollover: false } },
    });
    const rolling = subject({
      limits: { perMinute: 1000, perDay: 100_000 },
      billing: { billingDay: 1, overage: 0, credits: { grant: 3, rollover: true } },
    });
    for (const s of [plain, rolling]) {
      expect((await store.consume(s)).balance).toBe(2);
    }
    now = utc(2027, 4, 2); // February and March idle: three periods later
    expect((await store.consume(plain)).balance).toBe(2); // 3 granted, 1 spent: the 2 left in January expired
    expect((await store.consume(rolling)).balance).toBe(2 + 3 * 3 - 1);
    const [, grant] = await store.ledger(plain);
    expect(grant).toMatchObject({ kind: 'grant', amount: 3, periods: 3, expired: 2, balance: 3 });
    expect((await store.ledger(rolling))[1]).toMatchObject({ kind: 'grant', amount: 9, periods: 3, expired: 0, balance: 11 });
  });

  it('answers 402 out of credits, spends granted before purchased, and a top-up is applied once per key', async () => {
    const now = utc(2027, 1, 10);
    const store = new MemoryQuotaStore(() => now);
    const s = subject({
      limits: { perMinute: 1000, perDay: 100_000 },
      billing: { billingDay: 1, overage: 0, credits: { grant: 1, rollover: false } },
    });
    expect((await store.consume(s)).outcome).toBe('allowed');
    const out = await store.consume(s);
    expect(out.outcome).toBe('credits');
    expect(out.grantAtMs).toBe(utc(2027, 2, 1));
    const topUp = { amount: 2, reason: 'invoice 7', idempotencyKey: 'k1' };
    expect(await store.topUp(s, topUp)).toMatchObject({ balance: 2, replayed: false, conflict: false });
    expect(await store.topUp(s, topUp)).toMatchObject({ balance: 2, replayed: true, conflict: false });
    expect(await store.topUp(s, { ...topUp, amount: 3 })).toMatchObject({ replayed: true, conflict: true });
    expect((await store.peek(s)).credits).toEqual({ granted: 0, purchased: 2 });
    expect((await store.consume(s, 2)).balance).toBe(0);
  });

  it('admits up to the overage past the quota and says how far past', async () => {
    const store = new MemoryQuotaStore(() => utc(2027, 1, 10));
    // A quota of 5 a month and 2 of overage: refused at 7.
    const s = subject({ limits: { perMinute: 1000, perDay: 100_000, perMonth: 7 }, billing: { billingDay: 1, overage: 2 } });
    const overage = [];
    for (let i = 0; i < 7; i++) {
      const d = await store.consume(s);
      overage.push([d.overage, d.overageUsed]);
    }
    // Each request's own units past the quota, and the window's so far (what X-Quota-Overage says).
    expect(overage).toEqual([
      [0, 0],
      [0, 0],
      [0, 0],
      [0, 0],
      [0, 0],
      [1, 1],
      [1, 2],
    ]);
    expect((await store.consume(s)).outcome).toBe('month');
    await store.refund(s, utc(2027, 1, 10), 1); // the last one failed at the gateway: not billed
    expect((await store.peek(s)).overageUsed).toBe(1);
  });

  it('a refund past the quota takes back one unit of overage, even of a request admitted within the quota', async () => {
    const store = new MemoryQuotaStore(() => utc(2027, 1, 10));
    const s = subject({ limits: { perMinute: 1000, perDay: 100_000, perMonth: 7 }, billing: { billingDay: 1, overage: 2 } });
    const first = await store.consume(s); // within the quota
    for (let i = 0; i < 6; i++) await store.consume(s); // 7: two past the quota of 5
    expect((await store.peek(s)).overageUsed).toBe(2);
    await store.refund(s, first.nowMs, 1); // 6 delivered: one past the quota
    expect((await store.peek(s)).overageUsed).toBe(1);
    expect((await store.consume(s)).overage).toBe(1); // the 7th delivered is past it again
  });
});

describe('a billing day changed in mid-period', () => {
  it('keeps the period in force, its count and its grant until it ends; the new day applies from then', async () => {
    let now = utc(2027, 4, 1, 9);
    const store = new MemoryQuotaStore(() => now);
    const limits = { perMinute: 1000, perDay: 100_000, perMonth: 100 };
    const on = (billingDay: number): QuotaSubject =>
      subject({
        name: 'moved',
        limits,
        policy: policyHeader(limits),
        billing: { billingDay, overage: 0, credits: { grant: 10, rollover: false } },
      });
    await store.consume(on(1)); // April 1: the period from April 1, its grant
    now = utc(2027, 4, 20);
    await store.consume(on(1));
    // The account moves to the 25th on April 20: April 1 to May 1 stays in force, count and grant.
    const moved = await store.consume(on(25));
    expect(moved.period).toEqual({ startMs: utc(2027, 4, 1), endMs: utc(2027, 5, 1) });
    expect([moved.windows[2]!.used, moved.balance]).toEqual([3, 7]);
    now = utc(2027, 4, 26); // past the new day, within the old period: nothing new
    expect((await store.consume(on(25))).windows[2]!.used).toBe(4);
    now = utc(2027, 5, 1); // the old period ends: the new day's period (April 25 to May 25), counted afresh, granted once
    const next = await store.consume(on(25));
    expect(next.period).toEqual({ startMs: utc(2027, 4, 25), endMs: utc(2027, 5, 25) });
    expect([next.windows[2]!.used, next.balance]).toEqual([1, 9]);
    now = utc(2027, 5, 25);
    expect((await store.consume(on(25))).balance).toBe(9);
    expect((await store.ledger(on(25))).map((e) => [e.kind, e.atMs])).toEqual([
      ['grant', utc(2027, 4, 1, 9)],
      ['grant', utc(2027, 5, 1)],
      ['grant', utc(2027, 5, 25)],
    ]);
  });
});
