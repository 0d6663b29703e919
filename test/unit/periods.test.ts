import { describe, expect, it } from 'vitest';
import { loadSettings } from '../../gateway/config/settings.js';
import { settleOf, statusWait } from '../../gateway/quota/redis/event-batches.js';
import { CLOSE_RETRY_MS } from '../../gateway/usage/closes.js';
import { SETTLE_MS } from '../../gateway/usage/exporter.js';
import { statementOf, tallyPart } from '../../gateway/usage/periods.js';

// The tally of a part's events into billing periods, as each format sends them: what the
// statement and the close event are made of (test/integration/statements.test.ts runs it whole).

const event = (id: string, type: string, time: string, data: Record<string, unknown>) =>
  JSON.stringify({ specversion: '1.0', id, source: '/s', type, subject: 'acme', time, datacontenttype: 'application/json', data });
const REQUEST = 'com.petstore.gateway.request';
const REFUND = 'com.petstore.gateway.request.refunded';

describe('tallyPart', () => {
  it("counts OpenMeter's refund (the request's type, negative units, refundOf) as a refund, not a request, in its request's line", () => {
    const json = [
      event('acme/1', REQUEST, '2026-11-10T00:00:00.000Z', { plan: 'pro', route: 'listPets', units: 1, overage: 0 }),
      event('acme/1.refund', REQUEST, '2026-11-10T00:00:01.000Z', { refundOf: 'acme/1', units: -1 }),
    ].join(',');
    const { tally } = tallyPart(json, 1, 0);
    const s = Date.UTC(2026, 10, 1);
    expect(Object.fromEntries(tally.adds)).toEqual({
      [`${s}|events`]: 2,
      [`${s}|requests`]: 1,
      [`${s}|refunds`]: 1,
      [`${s}|refunded`]: 1,
      [`${s}|l|pro|listPets|n`]: 1,
      [`${s}|l|pro|listPets|u`]: 1,
      [`${s}|l|pro|listPets|r`]: 1,
      [`${s}|l|pro|listPets|ru`]: 1,
    });
  });

  it("puts a refund in its own line, its request's (named by the refund, or found in its part), or '?' for one not at hand", () => {
    const json = [
      event('acme/1', REQUEST, '2026-11-10T00:00:00.000Z', { plan: 'pro', route: 'listPets', units: 1, overage: 1 }),
      event('acme/2', REQUEST, '2026-11-10T00:00:00.000Z', { plan: 'pro', route: 'createPet', units: 5, overage: 0 }),
      // A bundle's refund: no line of its own, its request is in the part.
      event('acme/1.refund', REFUND, '2026-11-10T00:00:01.000Z', { refundOf: 'acme/1', units: -1, overage: -1 }),
      // refund.lua's: it names its line.
      event('acme/9.refund', REFUND, '2026-11-10T00:00:01.000Z', { refundOf: 'acme/9', units: -2, plan: 'pro', route: 'createPet' }),
      // A settled call's, its request long sent.
      event('acme/8.refund', REFUND, '2026-11-10T00:00:01.000Z', { refundOf: 'acme/8', units: -1 }),
    ].join(',');
    const { tally, json: out } = tallyPart(json, 1, 0);
    const s = Date.UTC(2026, 10, 1);
    const lines = Object.fromEntries([...tally.adds].filter(([f]) => f.includes('|l|')));
    // Each a count: the requests' and the refunds' apart (a statement nets them: statementOf).
    expect(lines).toEqual({
      [`${s}|l|pro|listPets|n`]: 1,
      [`${s}|l|pro|listPets|u`]: 1,
      [`${s}|l|pro|listPets|o`]: 1,
      [`${s}|l|pro|listPets|r`]: 1,
      [`${s}|l|pro|listPets|ru`]: 1,
      [`${s}|l|pro|listPets|ro`]: 1,
      [`${s}|l|pro|createPet|n`]: 1,
      [`${s}|l|pro|createPet|u`]: 5,
      [`${s}|l|pro|createPet|r`]: 1,
      [`${s}|l|pro|createPet|ru`]: 2,
      [`${s}|l|?|?|r`]: 1,
      [`${s}|l|?|?|ru`]: 1,
    });
    // The sink gets the line too (OpenMeter's group-by nets the refund in its request's route).
    const sent = JSON.parse(`[${out}]`) as Array<{ id: string; data: Record<string, unknown> }>;
    expect(sent.find((e) => e.id === 'acme/1.refund')!.data).toEqual({
      refundOf: 'acme/1',
      units: -1,
      overage: -1,
      plan: 'pro',
      route: 'listPets',
    });
  });

  it('puts each event in the period of its time by the billing day, and a grant and a top-up in the credits', () => {
    const json = [
      event('acme/a', REQUEST, '2026-11-14T23:59:59.999Z', { plan: 'pro', route: 'listPets', units: 2, overage: 1 }),
      event('acme/b', REQUEST, '2026-11-15T00:00:00.000Z', { plan: 'pro', route: 'listPets', units: 1, overage: 0 }),
      event('acme/g', 'com.petstore.gateway.credits.granted', '2026-11-15T00:00:00.000Z', { amount: 100 }),
      event('acme/t', 'com.petstore.gateway.credits.topped_up', '2026-11-16T00:00:00.000Z', { amount: 30 }),
    ].join(',');
    const { tally, json: out } = tallyPart(json, 15, 0);
    const [october, november] = [Date.UTC(2026, 9, 15), Date.UTC(2026, 10, 15)];
    expect(tally.adds.get(`${october}|units`)).toBe(2);
    expect(tally.adds.get(`${october}|overage`)).toBe(1);
    expect(tally.adds.get(`${november}|units`)).toBe(1);
    expect(tally.adds.get(`${november}|granted`)).toBe(100);
    expect(tally.adds.get(`${november}|purchased`)).toBe(30);
    expect(tally.ends.get(october)).toBe(november);
    expect(out).toBe(json); // nothing late: sent as it came
  });

  it('counts the credits a request spent, from the grant and purchased, and those a refund gave back, in the period of each', () => {
    const json = [
      event('acme/a', REQUEST, '2026-11-14T23:00:00.000Z', {
        plan: 'pro',
        route: 'createPet',
        units: 5,
        creditsApplied: { granted: 2, purchased: 3 },
      }),
      event('acme/b', REQUEST, '2026-11-15T01:00:00.000Z', {
        plan: 'pro',
        route: 'listPets',
        units: 1,
        creditsApplied: { granted: 0, purchased: 1 },
      }),
      event('acme/b.refund', REFUND, '2026-11-15T01:00:01.000Z', { refundOf: 'acme/b', units: -1, creditsReturned: 1 }),
      // A key without credits: nothing applied.
      event('acme/c', REQUEST, '2026-11-15T02:00:00.000Z', { plan: 'free', route: 'listPets', units: 1 }),
    ].join(',');
    const { tally } = tallyPart(json, 15, 0);
    const [october, november] = [Date.UTC(2026, 9, 15), Date.UTC(2026, 10, 15)];
    const figures = (s: number) =>
      Object.fromEntries(['appliedGranted', 'appliedPurchased', 'returned'].map((f) => [f, tally.adds.get(`${s}|${f}`) ?? 0]));
    expect(figures(october)).toEqual({ appliedGranted: 2, appliedPurchased: 3, returned: 0 });
    expect(figures(november)).toEqual({ appliedGranted: 0, appliedPurchased: 1, returned: 1 });
    const hash = Object.fromEntries([...tally.adds].map(([f, n]) => [f, String(n)]));
    expect(statementOf(hash, { startMs: november, endMs: Date.UTC(2026, 11, 15) }).credits).toEqual({
      granted: 0,
      purchased: 0,
      applied: { granted: 0, purchased: 1 },
      returned: 1,
    });
  });

  it('rewrites an event of a frozen period as a correction of the next, stamped at its start', () => {
    const json = event('acme/late', REQUEST, '2026-10-31T23:00:00.000Z', { plan: 'pro', route: 'listPets', units: 1, overage: 0 });
    const november = Date.UTC(2026, 10, 1);
    const { tally, json: out } = tallyPart(json, 1, november);
    expect(JSON.parse(out)).toMatchObject({
      id: 'acme/late',
      time: '2026-11-01T00:00:00.000Z',
      correctionof: '2026-10-01T00:00:00.000Z',
      originaltime: '2026-10-31T23:00:00.000Z',
    });
    expect(tally.adds.get(`${november}|corrections`)).toBe(1);
    expect(tally.adds.get(`${Date.UTC(2026, 9, 1)}|units`)).toBeUndefined();
  });
});

describe('statementOf', () => {
  const period = { startMs: Date.UTC(2026, 10, 1), endMs: Date.UTC(2026, 11, 1) };
  const p = `${period.startMs}|l|pro|`;
  it("nets each line's refunds, and reads a period tallied before lines had refunds as it was", () => {
    const hash = {
      [`${p}listPets|n`]: '3',
      [`${p}listPets|u`]: '3',
      [`${p}listPets|o`]: '2',
      [`${p}listPets|r`]: '1',
      [`${p}listPets|ru`]: '1',
      [`${p}listPets|ro`]: '1',
    };
    expect(statementOf(hash, period).lines).toEqual([{ plan: 'pro', route: 'listPets', requests: 3, refunds: 1, units: 2, overage: 1 }]);
    const before = { [`${p}createPet|n`]: '2', [`${p}createPet|u`]: '10' };
    expect(statementOf(before, period).lines).toEqual([
      { plan: 'pro', route: 'createPet', requests: 2, refunds: 0, units: 10, overage: 0 },
    ]);
  });
});

describe('the settle', () => {
  it("is the shipped settings' settleOf, and a busy account's period closes within 60 s of its end", () => {
    const shipped = loadSettings({});
    expect(settleOf(shipped)).toBe(SETTLE_MS);
    // A not-ready period is tried again at its settle's end (closes.ts, notYet), then every round.
    expect(SETTLE_MS + CLOSE_RETRY_MS).toBeLessThanOrEqual(57_000);
    // An event waits longer for its status (30 s for the request, 10 s to connect, twice 10 s for
    // headers, 2 s): one written past the settle goes into the next period as a correction.
    expect(statusWait(shipped)).toBe(62_000);
  });
});
