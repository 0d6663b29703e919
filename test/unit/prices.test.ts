import { describe, expect, it } from 'vitest';
import { validateConfigFile } from '../../gateway/config/config.js';
import { DIGEST, type Statement } from '../../gateway/usage/periods.js';
import { decimal, priced, pricesFor, pricesInForce } from '../../gateway/usage/prices.js';

// A statement's money (issue 49, item 6): each line's amount from its plan's prices, exact.

const statement = (lines: Statement['lines']): Statement => ({
  period: { start: '2026-11-01T00:00:00.000Z', end: '2026-12-01T00:00:00.000Z' },
  status: 'open',
  closedAt: null,
  lines,
  totals: { requests: 0, units: 0, refunds: { events: 0, units: 0 }, overage: 0, corrections: 0 },
  credits: { granted: 0, purchased: 0, applied: { granted: 0, purchased: 0 }, returned: 0 },
  events: 0,
  digest: { algorithm: DIGEST, value: '0'.repeat(64) },
});
const line = (plan: string, route: string, units: number, overage: number) => ({
  plan,
  route,
  requests: units,
  refunds: 0,
  units,
  overage,
});

describe('priced', () => {
  it('prices units within the quota at the unit price and past it at the overage price, exactly, no float in between', () => {
    const plans = { pro: { prices: { currency: 'USD', unit: '0.1', overage: '0.000000003' } }, free: {} };
    const s = priced(
      statement([line('pro', 'listPets', 3, 0), line('pro', 'createPet', 1_000_000_007, 1_000_000_000), line('free', 'listPets', 9, 0)]),
      plans,
    );
    expect(s.currency).toBe('USD');
    expect(s.lines.map((l) => [l.included, l.price, l.amount])).toEqual([
      [3, { unit: '0.1', overage: '0.000000003' }, '0.3'], // 3 x 0.1 in floats: 0.30000000000000004
      [7, { unit: '0.1', overage: '0.000000003' }, '3.7'], // 7 x 0.1 + 10^9 x 3 x 10^-9
      [9, null, null],
    ]);
    expect(s.totals.amount).toBe('4');
  });

  it('takes the unit price past the quota when no overage price is set, and gives a total of null when nothing is priced', () => {
    expect(priced(statement([line('payg', 'listPets', 4, 2)]), { payg: { prices: { currency: 'EUR', unit: '2.5' } } }).totals.amount).toBe(
      '10',
    );
    expect(priced(statement([line('pro', 'listPets', 4, 0)]), { pro: {} })).toMatchObject({ currency: null, totals: { amount: null } });
    // A plan named as Object's own properties are is no plan.
    expect(priced(statement([line('constructor', 'listPets', 1, 0)]), {}).lines[0]!.amount).toBeNull();
  });

  it('writes a decimal without trailing zeros, negative too (a line with more refunded than delivered in the period: refunds after its boundary)', () => {
    expect([decimal(0n), decimal(1_500_000_000n), decimal(-25n), decimal(123_000_000_010n)]).toEqual([
      '0',
      '1.5',
      '-0.000000025',
      '123.00000001',
    ]);
  });
});

describe('prices in the config', () => {
  const file = (prices: Record<string, unknown>, more: Record<string, unknown> = {}) => ({
    environment: 'production',
    plans: { pro: { perMinute: 10, perDay: 100, prices }, ...more },
    keys: [],
    unauthenticated: { perMinute: 5 },
    bans: { afterRejected: 5, withinSeconds: 60, durationSeconds: 60 },
  });
  const problems = (raw: unknown) => {
    try {
      validateConfigFile(raw, 'x.yaml');
      return [];
    } catch (err) {
      return (err as { problems: string[] }).problems;
    }
  };

  it('takes a decimal in quotes, says to quote a bare number, and holds every plan to one currency', () => {
    expect(problems(file({ currency: 'USD', unit: '0.002', overage: '1' }))).toEqual([]);
    expect(problems(file({ currency: 'USD', unit: 0.002 }))).toEqual([
      'plans.pro.prices.unit: Expected string: a price is a decimal in quotes, as "0.002" (unquoted, YAML reads a float)',
    ]);
    expect(problems(file({ currency: 'USD', unit: '-1' }))[0]).toMatch(/^plans\.pro\.prices\.unit: /);
    expect(problems(file({ currency: 'USD', unit: '1e-3' }))[0]).toMatch(/^plans\.pro\.prices\.unit: /);
    expect(problems(file({ currency: 'USD' }, { biz: { perMinute: 10, perDay: 100, prices: { currency: 'EUR' } } }))).toEqual([
      "plans: prices are in one currency, a statement's total in it; found USD, EUR",
    ]);
  });

  it('prices an ended period by the prices noted for its end, which name only the plans that had some; an open one, or a damaged note, by the config', () => {
    const then = { pro: { prices: { currency: 'USD', unit: '0.1' } }, free: {} };
    const kept = pricesInForce(then);
    expect(JSON.parse(kept)).toEqual({ pro: { prices: { currency: 'USD', unit: '0.1' } } });
    const now = { pro: { prices: { currency: 'USD', unit: '0.5' } }, free: {} };
    const s = statement([line('pro', 'listPets', 3, 0)]);
    expect([priced(s, pricesFor(kept, now)).totals.amount, priced(s, pricesFor(undefined, now)).totals.amount]).toEqual(['0.3', '1.5']);
    expect(priced(s, pricesFor('{"pro":', now)).totals.amount).toBe('1.5');
    // Noted when no plan had prices: none, whatever came since.
    expect(priced(s, pricesFor(pricesInForce({ pro: {} }), now)).totals.amount).toBeNull();
  });
});
