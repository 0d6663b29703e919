import { describe, expect, it } from 'vitest';
import { compileConfig, validateConfigFile } from '../../gateway/config/config.js';
import { admit } from '../../gateway/quota/admit.js';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { policyHeader } from '../../gateway/quota/headers.js';
import { MemoryQuotaStore } from '../../gateway/quota/memory-store.js';
import { makeKey, testConfig } from '../helpers/config.js';

// Shadow mode (enforce: false): every decision is made and counted as if enforced, and a
// refusal it calls for is reported instead of made.

const limits = { perMinute: 2, perDay: 100 };
const subject = (enforce: boolean): QuotaSubject => ({
  name: `gw:test:{k:${enforce}}`,
  limits,
  bans: { afterRejected: 2, withinMs: 60_000, durationMs: 900_000 },
  policy: policyHeader(limits),
  lasting: true,
  billing: NO_BILLING,
  events: 0,
  alerts: '',
  enforce,
});
const at = Date.UTC(2026, 10, 22, 10, 15, 17);

describe('shadow mode', () => {
  it('admits what an enforced subject would refuse, counts as it would, and says which refusal it was', async () => {
    const outcomes = async (s: QuotaSubject) => {
      const store = new MemoryQuotaStore(() => at);
      const seen = [];
      for (let i = 0; i < 6; i++) seen.push(await admit(store, s));
      return { seen, usage: await store.peek(s) };
    };
    const enforced = await outcomes(subject(true));
    const shadow = await outcomes(subject(false));
    expect(enforced.seen.map((a) => [a.outcome, a.refusal?.code])).toEqual([
      ['allowed', undefined],
      ['allowed', undefined],
      ['minute', 'rate_limited'],
      ['minute', 'rate_limited'],
      ['banned', 'key_banned'],
      ['banned', 'key_banned'],
    ]);
    expect(shadow.seen.map((a) => [a.outcome, a.refusal])).toEqual([
      ['allowed', undefined],
      ['allowed', undefined],
      ['would_minute', undefined],
      ['would_minute', undefined],
      ['would_banned', undefined],
      ['would_banned', undefined],
    ]);
    // The same windows, counts and ban: only the answers differ.
    expect(shadow.usage).toEqual(enforced.usage);
    // The windows as they stand, but no Retry-After on an answer that was not refused; nothing to refund.
    const { 'retry-after': wait, ...reported } = enforced.seen[2]!.headers;
    expect(wait).toBe('43');
    expect(shadow.seen[2]!.headers).toEqual(reported);
    expect(shadow.seen.slice(2).map((a) => a.countedAtMs)).toEqual([undefined, undefined, undefined, undefined]);
  });

  it('on a month and on credits: admits past them, spends nothing it did not have, and reports would_month and would_credits', async () => {
    const store = new MemoryQuotaStore(() => at);
    const monthly = { perMinute: 1000, perDay: 1000, perMonth: 2 };
    const base = { bans: null, lasting: true, enforce: false, events: 0, alerts: '' } as const;
    const month: QuotaSubject = { ...base, name: 'm', limits: monthly, policy: policyHeader(monthly), billing: NO_BILLING };
    const credits: QuotaSubject = {
      ...base,
      name: 'c',
      limits: { perMinute: 1000, perDay: 1000 },
      policy: policyHeader({ perMinute: 1000, perDay: 1000 }),
      billing: { billingDay: 1, overage: 0, credits: { grant: 1, rollover: false } },
    };
    const seen = async (s: QuotaSubject) => {
      const out = [];
      for (let i = 0; i < 3; i++) {
        const a = await admit(store, s);
        out.push([a.outcome, a.refusal?.code, a.headers['x-credits-remaining']]);
      }
      return out;
    };
    expect(await seen(month)).toEqual([
      ['allowed', undefined, undefined],
      ['allowed', undefined, undefined],
      ['would_month', undefined, undefined],
    ]);
    expect(await seen(credits)).toEqual([
      ['allowed', undefined, '0'],
      ['would_credits', undefined, '0'],
      ['would_credits', undefined, '0'],
    ]);
    expect((await store.peek(credits)).credits).toEqual({ granted: 0, purchased: 0 });
  });

  it('is set by a plan and overridden by a key', () => {
    const [onPlan, own, enforcedKey] = [makeKey('trial'), makeKey('free'), makeKey('trial')];
    const file = testConfig([onPlan, { ...own }, enforcedKey], {
      plans: { free: { perMinute: 5, perDay: 1000 }, trial: { perMinute: 5, perDay: 1000, enforce: false } },
    });
    file.keys[1]!.enforce = false;
    file.keys[2]!.enforce = true;
    const config = compileConfig(validateConfigFile(file, 'test'));
    const enforce = (id: string) => [...config.consumers.values()].find((c) => c.id === id)!.subject.enforce;
    expect([enforce(onPlan.id), enforce(own.id), enforce(enforcedKey.id)]).toEqual([false, false, true]);
    expect(config.addressSubject('127.0.0.1').enforce).toBe(true);
    expect(() => validateConfigFile({ ...file, plans: { ...file.plans, free: { perMinute: 5, perDay: 9, enforce: 'no' } } }, 'f')).toThrow(
      /plans\.free\.enforce: /,
    );
  });
});
