import { describe, expect, it } from 'vitest';
import { compileConfig, validateConfigFile } from '../../gateway/config/config.js';
import { type Decision, NO_BILLING, type Outcome, type QuotaSubject, windows } from '../../gateway/quota/decision.js';
import { headersOf } from '../../gateway/quota/admit.js';
import { policyHeader, rateLimitHeaders } from '../../gateway/quota/headers.js';
import { makeKey, testConfig } from '../helpers/config.js';

const free = { perMinute: 60, perDay: 1000 };
const policy = policyHeader(free);
// 2026-11-22T10:15:17.250Z: 42.75 s before the minute ends, 49 482.75 s before the day ends.
const now = Date.UTC(2026, 10, 22, 10, 15, 17, 250);
const minuteEnd = Date.UTC(2026, 10, 22, 10, 16) / 1000;
const dayEnd = Date.UTC(2026, 10, 23) / 1000;

const at = (outcome: Outcome, m: number, d: number, banUntilMs = 0, nowMs = now): Decision => ({
  outcome,
  nowMs,
  banUntilMs,
  windows: windows(free, nowMs, { minuteUsed: m, dayUsed: d }),
  overage: 0,
});
const allowed = (m: number, d: number) => at('allowed', m, d);

describe('rate-limit headers', () => {
  it('writes the policy in the draft-10 form', () => {
    expect(policy).toBe('"minute";q=60;w=60, "day";q=1000;w=86400');
    expect(policyHeader({ perMinute: 30, perDay: 0 })).toBe('"minute";q=30;w=60');
  });

  it.each([
    ['first request', 1, 1, { limit: '60', remaining: '59', reset: minuteEnd, rl: '"minute";r=59;t=43, "day";r=999;t=49483' }],
    ['last admitted', 60, 100, { limit: '60', remaining: '0', reset: minuteEnd, rl: '"minute";r=0;t=43, "day";r=900;t=49483' }],
    ['day nearer exhaustion', 10, 995, { limit: '1000', remaining: '5', reset: dayEnd, rl: '"minute";r=50;t=43, "day";r=5;t=49483' }],
    ['tie goes to the minute', 55, 995, { limit: '60', remaining: '5', reset: minuteEnd, rl: '"minute";r=5;t=43, "day";r=5;t=49483' }],
  ])('%s', (_, m, d, want) => {
    const h = rateLimitHeaders(allowed(m, d), policy);
    expect(h['x-ratelimit-limit']).toBe(want.limit);
    expect(h['x-ratelimit-remaining']).toBe(want.remaining);
    expect(h['x-ratelimit-reset']).toBe(String(want.reset));
    expect(h.ratelimit).toBe(want.rl);
    expect(h['ratelimit-policy']).toBe(policy);
    expect(h['retry-after']).toBeUndefined();
  });

  it('first refused by the minute: the minute window and Retry-After to its end', () => {
    const h = rateLimitHeaders(at('minute', 60, 100), policy);
    expect(h['x-ratelimit-remaining']).toBe('0');
    expect(h['x-ratelimit-reset']).toBe(String(minuteEnd));
    expect(h['retry-after']).toBe('43');
  });

  it('refused by the day while the minute is also spent: the violated day window', () => {
    const h = rateLimitHeaders(at('day', 60, 1000), policy);
    expect(h['x-ratelimit-limit']).toBe('1000');
    expect(h['x-ratelimit-reset']).toBe(String(dayEnd));
    expect(h['retry-after']).toBe('49483');
  });

  it('refused by the day: the day window, even with minute room left', () => {
    const h = rateLimitHeaders(at('day', 3, 1000), policy);
    expect(h['x-ratelimit-limit']).toBe('1000');
    expect(h['x-ratelimit-reset']).toBe(String(dayEnd));
    expect(h['retry-after']).toBe('49483');
  });

  it('a ban: remaining 0, reset and Retry-After at its end', () => {
    const banUntil = now + 899_001;
    const h = rateLimitHeaders(at('banned', 60, 100, banUntil), policy);
    expect(h['x-ratelimit-remaining']).toBe('0');
    expect(h['x-ratelimit-reset']).toBe(String(Math.ceil(banUntil / 1000)));
    expect(h['retry-after']).toBe('900');
    expect(h.ratelimit).toBe('"minute";r=0;t=900, "day";r=0;t=900');
  });

  it('a ban with the day used up: Retry-After and the day run to midnight, not to the ban end', () => {
    const banUntil = now + 900_000;
    const h = rateLimitHeaders(at('banned', 3, 1000, banUntil), policy);
    expect(h['retry-after']).toBe('49483');
    expect(h.ratelimit).toBe('"minute";r=0;t=900, "day";r=0;t=49483');
    expect(h['x-ratelimit-reset']).toBe(String(Math.ceil(banUntil / 1000)));
  });

  it('rolls over at the UTC minute and day boundaries', () => {
    const lastMs = Date.UTC(2026, 10, 22, 23, 59, 59, 999);
    const [m1, d1] = windows(free, lastMs, { minuteUsed: 1, dayUsed: 1 });
    const [m2, d2] = windows(free, lastMs + 1, { minuteUsed: 1, dayUsed: 1 });
    expect(m1!.resetMs).toBe(lastMs + 1);
    expect(d1!.resetMs).toBe(lastMs + 1);
    expect(m2!.resetMs).toBe(lastMs + 1 + 60_000);
    expect(d2!.resetMs).toBe(lastMs + 1 + 86_400_000);
    // Never 0 while still blocked: 1 ms before the boundary is still 1 s.
    const h = rateLimitHeaders({ outcome: 'minute', nowMs: lastMs, banUntilMs: 0, windows: [m1!, d1!], overage: 0 }, policy);
    expect(h['retry-after']).toBe('1');
  });
});

describe('headers shared within a second', () => {
  const subject = {
    name: 'gw:{k:k_1}',
    limits: free,
    bans: null,
    policy,
    lasting: true,
    enforce: true,
    billing: NO_BILLING,
    events: 0,
    alerts: '',
  };
  const within = (m: number, d: number, nowMs: number) => headersOf(at('allowed', m, d, 0, nowMs), subject);

  it('builds them again when the second or a count changes, and not otherwise', () => {
    const first = within(5, 50, now);
    expect(within(5, 50, now + 700)).toBe(first); // same second (…17.950), same counts: the same object
    // Each of these is exactly what rateLimitHeaders gives, never the shared object's stale values.
    const cases: Array<[number, number, number]> = [
      [5, 50, now + 750], // the next second: t= moves
      [6, 50, now + 750], // the minute count
      [6, 51, now + 750], // the day count
      [6, 51, now + 60_000], // the next minute
    ];
    for (const [m, d, t] of cases) expect(within(m, d, t)).toEqual(rateLimitHeaders(at('allowed', m, d, 0, t), policy));
    expect(within(5, 50, now + 750).ratelimit).toBe('"minute";r=55;t=42, "day";r=950;t=49482');
  });

  it("never shares a refusal's headers", () => {
    const refused = headersOf(at('minute', 60, 60), subject);
    expect(refused['retry-after']).toBe('43');
    expect(within(60, 60, now)['retry-after']).toBeUndefined();
  });

  it('shares them for a key, and keeps nothing for an address, whose subject is built per request', () => {
    const k = makeKey();
    const config = compileConfig(validateConfigFile(testConfig([k]), 't'));
    const admitted = (s: QuotaSubject): Decision => ({
      outcome: 'allowed',
      nowMs: now,
      banUntilMs: 0,
      windows: windows(s.limits, now, { minuteUsed: 1, dayUsed: 1 }),
      overage: 0,
    });
    const key = config.consumers.get(k.hash)!.subject;
    expect(headersOf(admitted(key), key)).toBe(headersOf(admitted(key), key));
    const address = config.addressSubject('10.0.0.1');
    const first = headersOf(admitted(address), address);
    expect(first).toEqual(rateLimitHeaders(admitted(address), address.policy));
    expect(headersOf(admitted(address), address)).not.toBe(first); // built again: no entry was kept for it
  });
});
