import { randomUUID } from 'node:crypto';
import fc from 'fast-check';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import type { EventTag, QuotaSubject } from '../../gateway/quota/decision.js';
import { subjectKey } from '../../gateway/redis/keys.js';
import { bundleEvents } from '../../gateway/usage/events.js';
import { LeasingInstance } from '../helpers/lease-instance.js';
import { testClient } from '../helpers/redis.js';

// Overage is billed for units delivered past the quota, whatever happens to leases: three
// instances on one real Redis take leases, hand them out, let them lapse, give them back,
// die holding them, and refund requests (502/504), in random orders; after every step the
// bill is checked against a plain count of what was delivered.

const QUOTA = 480;
const UP_TO = 20;
/** A lease at the shipped QUOTA_LEASE_MAX with these limits. */
const LEASE = 5;

// A billing day half a month away, so no run crosses its period's start.
const billingDay = ((new Date().getUTCDate() + 14) % 28) + 1;
const subject = (): QuotaSubject => ({
  name: `gw:test:{k:${randomUUID()}}`,
  // A minute roomier than the month: only the month and its overage decide.
  limits: { perMinute: 10_000, perDay: 0, perMonth: QUOTA + UP_TO },
  bans: null,
  policy: '',
  lasting: true,
  enforce: true,
  billing: { billingDay, overage: UP_TO },
  events: 0,
  alerts: '',
});

type Step =
  | { kind: 'send'; at: number; n: number }
  | { kind: 'lapse'; at: number }
  | { kind: 'kill'; at: number }
  | { kind: 'refund'; at: number };

const steps = fc.array(
  fc.oneof(
    { weight: 5, arbitrary: fc.record({ kind: fc.constant('send' as const), at: fc.nat(2), n: fc.integer({ min: 1, max: 120 }) }) },
    { weight: 2, arbitrary: fc.record({ kind: fc.constant('lapse' as const), at: fc.nat(2) }) },
    { weight: 1, arbitrary: fc.record({ kind: fc.constant('kill' as const), at: fc.nat(2) }) },
    { weight: 1, arbitrary: fc.record({ kind: fc.constant('refund' as const), at: fc.nat(2) }) },
  ),
  { minLength: 1, maxLength: 30 },
);

let redis: Redis;
beforeAll(() => {
  redis = testClient(inject('redisUrl'), { enableOfflineQueue: true });
});
afterAll(() => redis.quit());

/** Runs `plan` on three fresh instances; returns what was delivered, billed, and how many instances died. */
async function run(plan: Step[]) {
  const s = subject();
  const fleet = [0, 1, 2].map(() => new LeasingInstance(redis));
  const billed = async () => (await fleet[0]!.store.peek(s)).overageUsed ?? 0;
  let delivered = 0;
  let kills = 0;
  const send = async (at: LeasingInstance) => {
    const d = await at.store.consume(s);
    if (d.outcome === 'allowed') {
      delivered++;
      at.admitted.push(d);
    }
  };
  for (const step of plan) {
    const at = fleet[step.at]!;
    if (step.kind === 'send') for (let i = 0; i < step.n; i++) await send(at);
    else if (step.kind === 'lapse') at.lapse();
    else if (step.kind === 'kill') {
      // Dies holding whatever it holds: a new instance takes its place.
      fleet[step.at] = new LeasingInstance(redis);
      kills++;
    } else {
      const d = at.admitted.pop();
      if (d) {
        await at.store.refund(s, d.nowMs, 1);
        delivered--;
      }
    }
    // Never a unit billed that was not delivered past the quota, never past the overage allowed.
    const now = await billed();
    expect(now, JSON.stringify(step)).toBeLessThanOrEqual(Math.max(0, delivered - QUOTA));
    expect(now).toBeLessThanOrEqual(UP_TO);
  }
  // Every live instance closes its leases with its next call (a request, admitted or not).
  for (const at of fleet) {
    at.lapse();
    await send(at);
  }
  return { delivered, billed: await billed(), kills };
}

describe('overage with leases on three instances', () => {
  it('bills exactly the units delivered past the quota once the leases are closed; a dead holder leaves at most its leases unbilled', async () => {
    await fc.assert(
      fc.asyncProperty(steps, async (plan) => {
        const { delivered, billed, kills } = await run(plan);
        const due = Math.min(UP_TO, Math.max(0, delivered - QUOTA));
        if (kills === 0) expect(billed).toBe(due);
        else {
          expect(billed).toBeLessThanOrEqual(due);
          // What a dead instance held: its lease being handed out and the one taken ahead.
          expect(billed).toBeGreaterThanOrEqual(due - kills * 2 * LEASE);
        }
      }),
      { numRuns: 40, endOnFailure: true },
    );
  });

  it('a lease that lapses while another instance bills the overage is not billed again when given back (the trial: 108 for 100)', async () => {
    const { delivered, billed } = await run([
      { kind: 'send', at: 0, n: 3 }, // A takes a lease of 5 and hands out 3
      { kind: 'send', at: 1, n: QUOTA + UP_TO }, // B fills the quota and the overage (refused at the ceiling)
      { kind: 'lapse', at: 0 }, // A's lease lapses; its 2 unused units go back with its next call
      { kind: 'send', at: 1, n: 10 },
      { kind: 'send', at: 0, n: 10 },
    ]);
    expect(delivered).toBe(QUOTA + UP_TO);
    expect(billed).toBe(UP_TO);
  });

  it('a refund past the quota takes back one unit of overage, even of a request admitted within the quota', async () => {
    const { delivered, billed } = await run([
      { kind: 'send', at: 0, n: 1 }, // A's first request, within the quota
      { kind: 'send', at: 1, n: QUOTA + UP_TO },
      { kind: 'refund', at: 0 }, // the backend failed A's request after all (502)
    ]);
    expect(delivered).toBeGreaterThan(QUOTA);
    expect(billed).toBe(delivered - QUOTA);
  });

  it('a lease whose holder dies is never billed past what was delivered (the trial: 100 for 92)', async () => {
    const { delivered, billed } = await run([
      { kind: 'send', at: 0, n: 2 }, // A takes a lease of 5 and hands out 2
      { kind: 'kill', at: 0 }, // A dies holding 3
      { kind: 'send', at: 1, n: QUOTA + UP_TO },
    ]);
    expect(delivered).toBe(QUOTA + UP_TO - 3);
    // A's 2 delivered units are never known to Redis: billed for what it knows, never more.
    expect(billed).toBe(UP_TO - 5);
    expect(billed).toBeLessThanOrEqual(delivered - QUOTA);
  });
});

describe('overage with usage exported: a leased refund goes in its event batch', () => {
  it('takes back its unit of overage in the run of usagebatch.lua that writes the request and its refund', async () => {
    const s: QuotaSubject = { ...subject(), events: 10_000 };
    const [a, b] = [new LeasingInstance(redis), new LeasingInstance(redis)] as const;
    let delivered = 0;
    let n = 0;
    const send = async (at: LeasingInstance) => {
      const tag: EventTag = { requestId: `r${n++}`, keyId: 'k', plan: 'p', route: 'listPets', method: 'GET' };
      const d = await at.store.consume(s, 1, tag);
      if (d.outcome === 'allowed') delivered++;
      return { ...d, eventId: tag.eventId };
    };
    const first = await send(a); // within the quota, a unit of A's lease: its event waits in A
    expect(first.eventId).toMatch(/^lease:/);
    for (let i = 0; i < QUOTA + UP_TO; i++) await send(b);
    // The backend failed A's request after all (502): refunded, then its status.
    await a.store.refund(s, first.nowMs, 1, first.eventId);
    a.store.recordStatus(s, first.eventId!, 502);
    delivered--;
    // Both close their leases with a call after they lapse, then write every event they hold.
    for (const at of [a, b]) {
      at.lapse();
      await send(at);
      await at.store.close();
    }
    expect(delivered).toBeGreaterThan(QUOTA);
    expect((await a.store.peek(s)).overageUsed).toBe(delivered - QUOTA);
    const bundles = await redis.xrange(subjectKey.bundles(s.name), '-', '+');
    const fields = (f: string[]) => Object.fromEntries(f.flatMap((v, i) => (i % 2 ? [] : [[v, f[i + 1]]])));
    // A bundle holds its events as their instance wrote them, which the exporter frames
    // (bundleEvents; refunds apart here), and its refunds as `index units overage` (usagebatch.lua).
    const written = bundles
      .map(([id, list]) => ({ id, f: fields(list) }))
      .map(({ id, f }) => ({
        requests: (
          JSON.parse(`[${bundleEvents(s.name, '/src', { id, events: Number(f.n), upto: 0, data: f.data!, refunds: '' })}]`) as Array<{
            data: { requestId: string };
          }>
        ).map((e) => e.data.requestId),
        refunds: f.refunds,
      }));
    const bundle = written.find((w) => w.requests.includes('r0'))!;
    expect(bundle.refunds).toBe(`${bundle.requests.indexOf('r0')} 1 1`);
    expect(written.filter((w) => w.refunds !== '')).toHaveLength(1);
  });
});
