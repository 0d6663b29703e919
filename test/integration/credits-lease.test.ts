import { randomUUID } from 'node:crypto';
import fc from 'fast-check';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, inject, it, onTestFinished } from 'vitest';
import type { EventTag, QuotaSubject } from '../../gateway/quota/decision.js';
import { LeasingInstance } from '../helpers/lease-instance.js';
import { usageView } from '../../gateway/quota/usage-view.js';
import { leaseOf } from '../../gateway/quota/redis/lease-book.js';
import { EventBatches } from '../../gateway/quota/redis/event-batches.js';
import { addBatchEvent, batchEvents, defineScripts, quotaArgs, quotaReply, usageBatchArgs } from '../../gateway/quota/redis/script.js';
import { subjectKey } from '../../gateway/redis/keys.js';
import { bundleEvents } from '../../gateway/usage/events.js';
import { tallyPart } from '../../gateway/usage/periods.js';
import { echoBackend, type EchoBackend } from '../helpers/backends.js';
import { call, makeKey, tempDir, testConfig, uniquePrefix, writeConfig } from '../helpers/config.js';
import { startProcess } from '../helpers/processes.js';
import { BUDGET, timeoutFor } from '../helpers/budget.js';
import { eventually } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

// Credits at lease speed, exact: a lease reserves its credits from the balance in the same
// script (at most 1% of the balance), its holder spends them locally and gives back what it did
// not hand out when the lease closes; a lease its holder never closes (a killed instance) goes
// back whole once it lapsed in Redis. Spent = delivered, at every step and at the end.

// A billing day half a month away, so no run crosses its period's start (a new grant).
const billingDay = ((new Date().getUTCDate() + 14) % 28) + 1;
const subject = (grant: number): QuotaSubject => ({
  name: `gw:test:{k:${randomUUID()}}`,
  // Windows far roomier than the balance: only the credits decide.
  limits: { perMinute: 100_000, perDay: 1_000_000 },
  bans: null,
  policy: '',
  lasting: true,
  enforce: true,
  billing: { billingDay, overage: 0, credits: { grant, rollover: false } },
  events: 0,
  alerts: '',
});

let redis: Redis;
beforeAll(() => {
  redis = testClient(inject('redisUrl'), { enableOfflineQueue: true });
});
afterAll(() => redis.quit());

const steps = fc.array(
  fc.oneof(
    { weight: 5, arbitrary: fc.record({ kind: fc.constant('send' as const), at: fc.nat(1), n: fc.integer({ min: 1, max: 300 }) }) },
    { weight: 2, arbitrary: fc.record({ kind: fc.constant('lapse' as const), at: fc.nat(1) }) },
    { weight: 1, arbitrary: fc.record({ kind: fc.constant('refund' as const), at: fc.nat(1) }) },
  ),
  { minLength: 1, maxLength: 20 },
);

describe('credit leases on two instances', () => {
  it('spend exactly what was delivered: at every step within what the open leases hold, and exactly once they close', async () => {
    const B0 = 2000;
    await fc.assert(
      fc.asyncProperty(steps, async (plan) => {
        const s = subject(B0);
        const fleet = [new LeasingInstance(redis), new LeasingInstance(redis)];
        const credits = async () => (await fleet[0]!.store.peek(s)).credits!;
        let delivered = 0;
        const send = async (at: LeasingInstance) => {
          const d = await at.store.consume(s);
          if (d.outcome === 'allowed') {
            delivered++;
            at.admitted.push(d);
          } else expect(d.outcome).toBe('credits');
        };
        for (const step of plan) {
          const at = fleet[step.at]!;
          if (step.kind === 'send') for (let i = 0; i < step.n; i++) await send(at);
          else if (step.kind === 'lapse') at.lapse();
          else {
            const d = at.admitted.pop();
            if (d) {
              await at.store.refund(s, d.nowMs, 1);
              delivered--;
            }
          }
          // What left the balance is what was delivered, give or take what the open leases hold.
          const { granted, purchased, reserved = 0 } = await credits();
          const spent = B0 - granted - purchased;
          expect(delivered, JSON.stringify(step)).toBeLessThanOrEqual(spent);
          expect(delivered, JSON.stringify(step)).toBeGreaterThanOrEqual(spent - reserved);
        }
        // Each instance stops, closing its leases.
        for (const at of fleet) await at.store.close();
        const { granted, purchased, reserved } = await credits();
        expect({ spent: B0 - granted - purchased, reserved }).toEqual({ spent: delivered, reserved: 0 });
      }),
      { numRuns: 15 },
    );
  });

  it('answer 402 only once the balance is spent but for what the other instance holds (at most 1% of it), and admit that once it is given back', async () => {
    const s = subject(1000);
    const [a, b] = [new LeasingInstance(redis), new LeasingInstance(redis)];
    expect((await a.store.consume(s)).outcome).toBe('allowed'); // a lease of 10 (1% of 1,000): A holds 9
    let byB = 0;
    while ((await b.store.consume(s)).outcome === 'allowed') byB++;
    expect(byB).toBe(990);
    // The 402 came with A's lease reserved: that is the bound, 1% of the balance A took it from.
    expect((await b.store.peek(s)).credits).toMatchObject({ granted: 0, reserved: 10 });
    // The client's own view (/v1/me/usage) says so too: nothing left, 10 held.
    expect(usageView({ account: 'a', plan: 'p', subject: s }, await b.store.peek(s)).credits).toMatchObject({ balance: 0, reserved: 10 });
    a.lapse();
    expect((await a.store.consume(s)).outcome).toBe('allowed'); // closes its lease (9 back), then one of them
    let more = 0;
    while ((await b.store.consume(s)).outcome === 'allowed') more++;
    expect(more).toBe(8);
    expect((await b.store.peek(s)).credits).toMatchObject({ granted: 0, purchased: 0, reserved: 0 });
  });

  it('a refunded unit of a lease gives its credit back, and the lease closes without counting it twice', async () => {
    const s = subject(2000);
    const a = new LeasingInstance(redis);
    const first = await a.store.consume(s); // a lease of 20
    expect(first.leased).toBe(false);
    const fromLease = await a.store.consume(s);
    expect(fromLease.leased).toBe(true);
    await a.store.refund(s, fromLease.nowMs, 1); // its backend answered 502
    await a.store.close(); // closes the lease: its 18 not handed out back
    const { granted, purchased, reserved } = (await a.store.peek(s)).credits!;
    // Delivered: the first; the refunded one is not charged, nor counted again when its lease closes.
    expect({ spent: 2000 - granted - purchased, reserved }).toEqual({ spent: 1, reserved: 0 });
  });
});

describe('a gateway process killed holding a credit lease', () => {
  let echo: EchoBackend;
  beforeAll(async () => {
    echo = await echoBackend();
  });
  afterAll(() => echo?.close());

  it("gives the lease back whole once it lapses in Redis (ledger: lapsed): the customer loses nothing, the units it delivered go unpaid; a live holder's lapsed lease is closed by its holder", {
    timeout: timeoutFor(61_000, 90_000, BUDGET.change),
  }, async () => {
    const key = { ...makeKey('prepaid') };
    const other = { ...makeKey('prepaid') };
    const token = 'admin-token-0123456789';
    const { dir, cleanup } = tempDir();
    const file = `${dir}/gateway.json`;
    // 2,000 credits: leases of 20. The windows are far roomier: only the credits decide.
    writeConfig(
      file,
      testConfig([key, other], {
        plans: { prepaid: { perMinute: 100_000, perDay: 1_000_000, credits: { grant: 2000, every: 'month' } } },
        accounts: { [key.id]: { billingDay }, [other.id]: { billingDay } },
      }),
    );
    const env = {
      REDIS_URL: inject('redisUrl'),
      GATEWAY_CONFIG: file,
      BACKEND_URL: echo.url,
      REDIS_KEY_PREFIX: uniquePrefix(),
      ADMIN_TOKEN: token,
    };
    const start = async () => {
      const g = await startProcess(
        'dist/gateway/server.js',
        { GATEWAY_PORT: '0', ADMIN_PORT: '0', ...env },
        (l) => l.msg === 'gateway ready',
      );
      const ready = g.logs.find((l) => l.msg === 'gateway ready')!;
      return { ...g, url: String(ready.address), admin: String(ready.admin) };
    };
    try {
      const [victim, survivor] = [await start(), await start()];
      // A 503 (Redis slower than REDIS_TIMEOUT_MS on this loaded machine) is not charged: asked again, as a client would.
      const status = async (url: string, k: string): Promise<number> => {
        for (;;) {
          const res = await call(`${url}/v1/pets`, k);
          await res.arrayBuffer();
          if (res.status !== 503) return res.status;
        }
      };
      const creditsOf = async (id: string) =>
        (await (
          await fetch(`${survivor.admin}/admin/accounts/${id}/credits`, { headers: { authorization: `Bearer ${token}` } })
        ).json()) as {
          balance: number;
          reserved: number;
          ledger: Array<{ kind: string; amount: number }>;
        };
      // The lease is taken early in a minute, so it lapses in Redis at least 65 s later: time for the
      // survivor to spend the rest of the balance first, however loaded the machine.
      await eventually(() => Date.now() % 60_000 < 5_000, 61_000, 'a minute starting');
      // The victim takes a lease of 20 and delivers 3 of it; the survivor holds a lease of the other account.
      for (let i = 0; i < 3; i++) expect(await status(victim.url, key.key)).toBe(200);
      expect(await status(survivor.url, other.key)).toBe(200);
      expect(await creditsOf(key.id)).toMatchObject({ balance: 1980, reserved: 20 });
      victim.proc.kill('SIGKILL');
      await new Promise((r) => victim.proc.once('exit', r));
      // The survivor spends all the balance not held, then 402 while the dead lease is reserved (20 at a time).
      const statuses = (
        await Promise.all(
          Array.from({ length: 20 }, async () => {
            const mine: number[] = [];
            while (mine.at(-1) !== 402) mine.push(await status(survivor.url, key.key));
            return mine;
          }),
        )
      ).flat();
      let admitted = statuses.filter((s) => s === 200).length;
      expect({ admitted, other: statuses.filter((s) => s !== 200 && s !== 402) }).toEqual({ admitted: 1980, other: [] });
      expect(await creditsOf(key.id)).toMatchObject({ balance: 0, reserved: 20 });
      // Once the dead lease lapses in Redis (its minute's end and the grace), the next call gives it back whole.
      await eventually(async () => (await status(survivor.url, key.key)) === 200, 90_000, 'the dead lease given back');
      admitted++;
      while ((await status(survivor.url, key.key)) === 200) admitted++;
      expect(admitted).toBe(2000);
      const after = await creditsOf(key.id);
      expect(after).toMatchObject({ balance: 0, reserved: 0 });
      // 2,003 delivered for 2,000 paid: the 3 the victim delivered before dying, at most its lease.
      expect(after.ledger.filter((e) => e.kind === 'lapsed').map((e) => e.amount)).toEqual([20]);
      // The survivor's own lease of the other account lapsed too, but its holder closed it: no lapsed entry, nothing held.
      // Its holder's timer closed it at its minute's end, before the dead lease (of the same minute) lapsed in Redis.
      await eventually(async () => (await creditsOf(other.id)).reserved === 0, undefined, "the survivor's lease closed");
      const closed = await creditsOf(other.id);
      expect({ balance: closed.balance, lapsed: closed.ledger.filter((e) => e.kind === 'lapsed') }).toEqual({ balance: 1999, lapsed: [] });
      await survivor.stop();
    } finally {
      cleanup();
    }
  });
});

// Credits and usage export on one key, both leased: a leased unit's credit is spent from its
// lease's hold when its event is written (usagebatch.lua), so a lease that lapses (its holder
// died) gives back only the units with no event, and the balance agrees with the sink: spent =
// events written net of refunds. The scripts as the store defines them, on the run's Redis.
describe('a key with credits and usage export, leased', () => {
  const both = (): QuotaSubject => ({ ...subject(2000), events: 10_000 });
  const scripts = () => {
    const r = redis.duplicate().on('error', () => {});
    onTestFinished(() => r.quit().then(() => undefined));
    defineScripts(r);
    return r as unknown as Record<'quota' | 'usagebatch', (...args: Array<string | number>) => Promise<unknown>>;
  };
  const tag = (rid: string) => ({ requestId: rid, keyId: 'k', plan: 'prepaid', route: 'listPets', method: 'GET' });
  /** Five units of the lease `lease` written in one batch, the fifth refunded (its backend failed): the batch's values. */
  const fiveEvents = (lease: string) => {
    const events = batchEvents();
    for (let i = 0; i < 5; i++)
      addBatchEvent(events, { at: Date.now(), tag: tag(`r${i}`), status: 200, windows: '1,null,1,null' }, i === 4 ? 1 : 0, lease);
    return events;
  };
  const credited = async (s: QuotaSubject) => {
    const [g, p, r] = await redis.hmget(subjectKey.credits(s.name), 'g', 'p', 'r');
    return { balance: Number(g) + Number(p), reserved: Number(r) };
  };

  it('is leased like a key with either alone: the units after the first come from its lease', async () => {
    const s = both();
    const a = new LeasingInstance(redis);
    onTestFinished(() => a.store.close());
    const first = await a.store.consume(s, 1, tag('r0'));
    const nextTag: EventTag = tag('r1');
    const next = await a.store.consume(s, 1, nextTag);
    expect([first.leased, next.leased, EventBatches.isLeased(nextTag.eventId ?? '')]).toEqual([false, true, true]);
  });

  it('spends the written units from a lapsed lease: its lapse gives back only the units with no event', async () => {
    const s = both();
    const run = scripts();
    // A lease of 20 (1% of 2,000), its first unit to this request; its call's id is the lease's.
    const taken = quotaReply(
      (await run.quota(...quotaArgs(s, { lease: 20, deadline: 0, cost: 1, refill: false, tag: tag('r0'), callId: 'L1' }))) as Array<
        number | string | null
      >,
    );
    expect({ taken: taken.taken, ...(await credited(s)) }).toEqual({ taken: 20, balance: 1980, reserved: 20 });
    // Its holder writes five events (one refunded), then dies: the lease is never closed.
    expect(await run.usagebatch(...usageBatchArgs(s, 'i:1', fiveEvents('L1')))).toBe(5);
    expect(await credited(s)).toEqual({ balance: 1981, reserved: 15 });
    // Its minute and the grace over (rather than 70 s waited): the hold's lapse time in the past.
    const hold = (await redis.hget(subjectKey.credits(s.name), 'h:L1'))!;
    await redis.hset(subjectKey.credits(s.name), 'h:L1', hold.replace(/\d+$/, '1'), 'rx', 1);
    await run.quota(...quotaArgs(s, { lease: 1, deadline: 0, cost: 1, refill: false, tag: tag('r1'), callId: 'L2' }));
    // Back: the 15 with no event. Spent: the 4 written net of the refund, and the one just admitted.
    expect(await credited(s)).toEqual({ balance: 2000 - 4 - 1, reserved: 0 });
    const ledger = await redis.xrange(subjectKey.ledger(s.name), '-', '+');
    expect(ledger.filter(([, f]) => f[1] === 'lapsed').map(([, f]) => f[3])).toEqual(['15']);
  });

  it('spends nothing twice when its holder closes the lease before the batch is written', async () => {
    const s = both();
    const run = scripts();
    await run.quota(...quotaArgs(s, { lease: 20, deadline: 0, cost: 1, refill: false, tag: tag('r0'), callId: 'L1' }));
    // Closed with 15 not handed out (the request, four more, and the refunded one were), then the batch.
    const back = {
      ...leaseOf(15, 20, 0, Date.now(), { minuteUsed: 20, dayUsed: 20, balance: 1980 }, 'L1'),
      credits: [['L1', 15]] as Array<[string, number]>,
    };
    await run.quota(...quotaArgs(s, { lease: 1, deadline: 0, cost: 0, refill: true, back, callId: 'L2' }));
    expect(await run.usagebatch(...usageBatchArgs(s, 'i:1', fiveEvents('L1')))).toBe(5);
    // Spent: the five handed out, less the refunded one, given back as a purchased credit.
    expect(await credited(s)).toEqual({ balance: 2000 - 4, reserved: 0 });
  });

  it('gives back the units a closed lease handed out when their holder dies before its batch: spent only with their events', async () => {
    const s = both();
    const run = scripts();
    await run.quota(...quotaArgs(s, { lease: 20, deadline: 0, cost: 1, refill: false, tag: tag('r0'), callId: 'L1' }));
    // Closed with 15 not handed out: the 5 handed out stay held until their events are written.
    const back = {
      ...leaseOf(15, 20, 0, Date.now(), { minuteUsed: 20, dayUsed: 20, balance: 1980 }, 'L1'),
      credits: [['L1', 15]] as Array<[string, number]>,
      events: true,
    };
    await run.quota(...quotaArgs(s, { lease: 1, deadline: 0, cost: 0, refill: true, back, callId: 'L2' }));
    expect(await credited(s)).toEqual({ balance: 1995, reserved: 5 });
    // The holder dies with its batch: the rest lapses (its time set in the past rather than 70 s waited), all of it back.
    const hold = (await redis.hget(subjectKey.credits(s.name), 'h:L1'))!;
    await redis.hset(subjectKey.credits(s.name), 'h:L1', hold.replace(/\d+$/, '1'), 'rx', 1);
    await run.quota(...quotaArgs(s, { lease: 1, deadline: 0, cost: 0, refill: true, callId: 'L3' }));
    expect(await credited(s)).toEqual({ balance: 2000, reserved: 0 });
    const ledger = await redis.xrange(subjectKey.ledger(s.name), '-', '+');
    expect(ledger.filter(([, f]) => f[1] === 'lapsed').map(([, f]) => f[3])).toEqual(['5']);
  });

  /** Redis's bundle of `s` (one batch written) as the exporter reads it, and its events as the sink gets them. */
  const bundleOf = async (s: QuotaSubject) => {
    const [[id, f]] = (await redis.xrange(subjectKey.bundles(s.name), '-', '+')) as [[string, string[]]];
    const field = (name: string) => f[f.indexOf(name) + 1]!;
    const bundle = {
      id,
      events: Number(field('n')),
      upto: Number(field('upto')),
      data: field('data'),
      refunds: field('refunds'),
      credits: field('credits'),
    };
    const json = bundleEvents(s.name, '/src', bundle);
    const events = JSON.parse(`[${json}]`) as Array<{ data: { creditsApplied?: unknown; creditsReturned?: number; refundOf?: string } }>;
    return { bundle, json, events };
  };
  const balance = async (s: QuotaSubject) => (await redis.hmget(subjectKey.credits(s.name), 'g', 'p', 'r')).map(Number);

  it("names what paid each event, by the event's own lease, the grant first; a refund gives its event's credit back as purchased: the statement splits them so", async () => {
    const s = { ...subject(3), events: 10_000 };
    const run = scripts();
    const a = new LeasingInstance(redis);
    onTestFinished(() => a.store.close());
    await a.store.topUp(s, { amount: 2000, reason: 'test', idempotencyKey: randomUUID() });
    expect(await balance(s)).toEqual([3, 2000, 0]);
    // L1, a lease of 20 (1% of 2,003): the grant's 3 and 17 purchased; then L2, 19 (1% of 1,983), all purchased.
    await run.quota(...quotaArgs(s, { lease: 20, deadline: 0, cost: 1, refill: false, tag: tag('r0'), callId: 'L1' }));
    await run.quota(...quotaArgs(s, { lease: 20, deadline: 0, cost: 1, refill: false, tag: tag('r1'), callId: 'L2' }));
    expect(await balance(s)).toEqual([0, 2000 - 17 - 19, 39]);
    // One batch, its events from both leases in turn, the second (one of L1's) refunded.
    const events = batchEvents();
    ['L2', 'L1', 'L2', 'L1', 'L1', 'L1'].forEach((lease, i) =>
      addBatchEvent(events, { at: Date.now(), tag: tag(`e${i}`), status: 200, windows: '1,null,1,null' }, i === 1 ? 1 : 0, lease),
    );
    expect(await run.usagebatch(...usageBatchArgs(s, 'i:1', events))).toBe(6);
    const { bundle, json, events: sent } = await bundleOf(s);
    // L2's events purchased; L1's first three its grant's, its fourth purchased.
    expect(bundle.credits).toBe('pgpggp');
    const [g, p] = [
      { granted: 1, purchased: 0 },
      { granted: 0, purchased: 1 },
    ];
    expect(sent.map((e) => e.data.creditsApplied ?? e.data.creditsReturned)).toEqual([p, g, p, g, g, p, 1]);
    const { tally } = tallyPart(json, billingDay, 0);
    const figures = Object.fromEntries(
      [...tally.adds].filter(([k]) => /\|(applied\w+|returned)$/.test(k)).map(([k, n]) => [k.split('|')[1], n]),
    );
    expect(figures).toEqual({ appliedGranted: 3, appliedPurchased: 3, returned: 1 });
    // The balance says the same: the refunded credit back as purchased, 16 of L1 and 17 of L2 still held.
    expect(await balance(s)).toEqual([0, 2000 - 17 - 19 + 1, 16 + 17]);
  });

  it('spends nothing for an event written after its hold lapsed, and gives nothing back for its refund: the lapse gave its credit back', async () => {
    const s = both();
    const run = scripts();
    await run.quota(...quotaArgs(s, { lease: 20, deadline: 0, cost: 1, refill: false, tag: tag('r0'), callId: 'L1' }));
    // Its holder slow (a request that waited long on the backend): the lease lapses first (its time set in the past rather than 70 s waited).
    const hold = (await redis.hget(subjectKey.credits(s.name), 'h:L1'))!;
    await redis.hset(subjectKey.credits(s.name), 'h:L1', hold.replace(/\d+$/, '1'), 'rx', 1);
    await run.quota(...quotaArgs(s, { lease: 1, deadline: 0, cost: 0, refill: true, callId: 'L2' }));
    expect(await credited(s)).toEqual({ balance: 2000, reserved: 0 });
    // Then its batch: five events, the fifth refunded.
    expect(await run.usagebatch(...usageBatchArgs(s, 'i:1', fiveEvents('L1')))).toBe(5);
    const { bundle, events } = await bundleOf(s);
    expect(bundle.credits).toBe('-----');
    expect(events.filter((e) => e.data.creditsApplied !== undefined || e.data.creditsReturned !== undefined)).toEqual([]);
    // Delivered unpaid (the lapse's way), and not a credit more.
    expect(await credited(s)).toEqual({ balance: 2000, reserved: 0 });
  });
});
