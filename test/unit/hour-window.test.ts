import { describe, expect, it } from 'vitest';
import { compileConfig, ConfigError, validateConfigFile } from '../../gateway/config/config.js';
import { admit } from '../../gateway/quota/admit.js';
import { leaseSize, NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { policyHeader } from '../../gateway/quota/headers.js';
import { MemoryQuotaStore } from '../../gateway/quota/memory-store.js';
import { makeKey, testConfig } from '../helpers/config.js';

// The hour window (windows.ts's row `hour`): UTC hours, its own RateLimit item and its own 429,
// decided by the in-process store on an injected clock. Each case is a moment and a count of
// requests admitted before it in this hour; the store is filled to that count, then asked once.

const limits = { perMinute: 100, perHour: 3, perDay: 1000 };
const subject: QuotaSubject = {
  name: 'gw:test:{k:hourly}',
  limits,
  bans: null,
  policy: policyHeader(limits),
  lasting: false,
  billing: NO_BILLING,
  events: 0,
  alerts: '',
  enforce: true,
};
const HOUR = Date.UTC(2026, 10, 22, 10); // 10:00:00.000 UTC

/** A store whose clock reads `moments` in turn (the last one from then on), for `subject`'s requests. */
function storeAt(...moments: number[]) {
  let i = 0;
  return new MemoryQuotaStore(() => moments[Math.min(i++, moments.length - 1)]!);
}

describe('the hour window', () => {
  it('is an item of RateLimit-Policy between the minute and the day', () => {
    expect(subject.policy).toBe('"minute";q=100;w=60, "hour";q=3;w=3600, "day";q=1000;w=86400');
    expect(policyHeader({ perMinute: 100, perDay: 1000 })).toBe('"minute";q=100;w=60, "day";q=1000;w=86400');
  });

  it.each([
    // name, moments of the requests before, the moment of the one asked, its outcome, code, RateLimit, Retry-After
    ['first request', [], HOUR + 5_000, 'allowed', undefined, '"minute";r=99;t=55, "hour";r=2;t=3595, "day";r=999;t=50395', undefined],
    [
      'last admitted',
      [HOUR, HOUR + 61_000],
      HOUR + 125_000,
      'allowed',
      undefined,
      '"minute";r=99;t=55, "hour";r=0;t=3475, "day";r=997;t=50275',
      undefined,
    ],
    [
      'first refused',
      [HOUR, HOUR + 61_000, HOUR + 125_000],
      HOUR + 1_800_000,
      'hour',
      'hourly_quota_exceeded',
      '"minute";r=100;t=60, "hour";r=0;t=1800, "day";r=997;t=48600',
      '1800',
    ],
    [
      "still refused at the hour's last millisecond",
      [HOUR, HOUR + 61_000, HOUR + 125_000],
      HOUR + 3_599_999,
      'hour',
      'hourly_quota_exceeded',
      '"minute";r=100;t=1, "hour";r=0;t=1, "day";r=997;t=46801',
      '1',
    ],
    [
      'admitted again once the UTC hour rolls over, the day still counting',
      [HOUR, HOUR + 61_000, HOUR + 125_000],
      HOUR + 3_600_000,
      'allowed',
      undefined,
      '"minute";r=99;t=60, "hour";r=2;t=3600, "day";r=996;t=46800',
      undefined,
    ],
  ] as const)('%s', async (_name, before, asked, outcome, code, state, retry) => {
    const store = storeAt(...before, asked);
    for (let i = 0; i < before.length; i++) expect((await admit(store, subject)).outcome).toBe('allowed');
    const a = await admit(store, subject);
    expect([a.outcome, a.refusal?.code, a.headers.ratelimit, a.headers['retry-after']]).toEqual([outcome, code, state, retry]);
    expect(a.headers['ratelimit-policy']).toBe(subject.policy);
    if (code) {
      expect(a.refusal?.message).toBe(`Hourly limit of 3 requests reached; retry after ${retry} s`);
      // The X- headers describe the violated window: the hour, reset at the next UTC hour.
      expect([a.headers['x-ratelimit-limit'], a.headers['x-ratelimit-remaining'], a.headers['x-ratelimit-reset']]).toEqual([
        '3',
        '0',
        String((HOUR + 3_600_000) / 1000),
      ]);
    }
  });

  it('bounds a lease by the hour: no lease reaches past what any window has left', () => {
    expect(leaseSize({ perMinute: 10_000, perHour: 300, perDay: 1_000_000 }, 20)).toBe(3);
    expect(leaseSize({ perMinute: 10_000, perDay: 1_000_000 }, 20)).toBe(20);
  });

  it('is read from plans and keys as perHour, optional', () => {
    const planKey = makeKey('hourly');
    const ownKey = { ...makeKey('enterprise'), limits: { perMinute: 10, perHour: 50, perDay: 500 } };
    const file = testConfig([planKey, ownKey], {
      plans: { hourly: { perMinute: 60, perHour: 600, perDay: 5000 }, enterprise: { custom: true } },
    });
    const config = compileConfig(validateConfigFile(file, 'test'));
    expect(config.consumers.get(planKey.hash)!.subject.limits).toEqual({ perMinute: 60, perHour: 600, perDay: 5000 });
    expect(config.consumers.get(ownKey.hash)!.subject.policy).toBe('"minute";q=10;w=60, "hour";q=50;w=3600, "day";q=500;w=86400');
    const bad = testConfig([], { plans: { hourly: { perMinute: 60, perHour: 0, perDay: 5000 } } });
    expect(() => validateConfigFile(bad, 'test')).toThrow(ConfigError);
  });
});
