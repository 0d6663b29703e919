import { Redis } from 'ioredis';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { BillerSink, NO_CUSTOMER, TOO_OLD } from '../../gateway/usage/biller-sink.js';
import { STRIPE_API_VERSION } from '../../gateway/usage/stripe-session.js';
import { subjectKey } from '../../gateway/redis/keys.js';
import { startLago, startStripe } from '../helpers/billers.js';
import { call, makeKey, type TestKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { eventually } from '../helpers/time.js';
import { usageEvent } from '../helpers/sink.js';
import { halfBroken } from '../helpers/backends.js';

// Stripe's and Lago's sink profiles (issue 49, items 1 and 4) against doubles keeping the
// billers' rules (test/helpers/billers.ts), through a real gateway and Redis, at the shipped
// batchSize (500, which the profiles cap at the billers' 100). A biller that kept a batch and
// then failed (503) gets it again: its duplicate answer (Stripe's 400, Lago's whole-batch 422)
// counts as delivered, the batch's new events land, and each meter equals the units delivered.

const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };
const SHOP_REQUESTS = 240;
const GHOST_REQUESTS = 6;

const metric = async (gw: TestGateway, name: string) =>
  Number(/ (\d+)$/m.exec(await gw.gateway.metrics.registry.getSingleMetricAsString(name))?.[1] ?? Number.NaN);

const subjectOf = (gw: TestGateway, id: string) => [...gw.gateway.config().consumers.values()].find((c) => c.id === id)!.subject;

/** A Stripe sink for the account shop at the shipped batch size (the profile caps it at Stripe's 100). */
const stripeSink = (url: string, headers?: Record<string, string>) =>
  new BillerSink({ url, maxEvents: 1_000_000, batchSize: 500, format: 'stripe', customers: { shop: 'cus_shop' } }, headers);

/** Requests one at a time (the backend's every-other drop then falls on every other one): how many were answered 200. */
async function send(gw: TestGateway, key: TestKey, n: number): Promise<number> {
  let delivered = 0;
  for (let i = 0; i < n; i++) {
    const res = await call(`${gw.url}/v1/pets`, key.key, { headers: { connection: 'close' } });
    await res.arrayBuffer();
    if (res.status === 200) delivered++;
    else expect(res.status).toBe(502);
  }
  return delivered;
}

/**
 * Shop (mapped) and ghost (no customer) send while the biller holds its first answer, so a round
 * then reads over 100 of shop's events; the biller keeps its next three batches and answers them 503.
 */
async function run(format: 'stripe' | 'lago', url: string, gate: { release: () => void }) {
  const [shop, ghost] = [makeKey('metered'), makeKey('metered')];
  const gw = await buildTestGateway({
    config: testConfig([shop, ghost], {
      plans,
      usage: { export: { url, maxEvents: 1_000_000, batchSize: 500, format, customers: { [shop.id]: 'cus_shop' } } },
    }),
    backend: await halfBroken(),
  });
  onTestFinished(() => gw.close());
  const delivered = await send(gw, shop, SHOP_REQUESTS);
  const ghostEvents = 2 * GHOST_REQUESTS - (await send(gw, ghost, GHOST_REQUESTS));
  const [shopSubject, ghostSubject] = [subjectOf(gw, shop.id), subjectOf(gw, ghost.id)];
  // Over 100 of shop's events wait behind the held answer: more than one biller batch.
  await eventually(async () => (await gw.gateway.store.exportState!(shopSubject)).pending > 100, 20_000, 'shop events waiting');
  gate.release();
  const shopEvents = SHOP_REQUESTS + (SHOP_REQUESTS - delivered);
  await eventually(
    async () => {
      const [s, g] = [await gw.gateway.store.exportState!(shopSubject), await gw.gateway.store.exportState!(ghostSubject)];
      return s.pending === 0 && s.exported + s.rejected === shopEvents && g.pending === 0 && g.exported + g.rejected === ghostEvents;
    },
    40_000,
    'every event of both accounts out',
  );
  return { gw, shop, ghost, delivered, shopEvents, ghostEvents, shopSubject, ghostSubject };
}

/** Ghost's events, set aside with the reason, none at the biller; shop's all exported, none set aside. */
async function checkAccounts(r: Awaited<ReturnType<typeof run>>) {
  expect(await r.gw.gateway.store.exportState!(r.shopSubject)).toMatchObject({ exported: r.shopEvents, pending: 0, rejected: 0 });
  expect(await r.gw.gateway.store.exportState!(r.ghostSubject)).toMatchObject({ exported: 0, pending: 0, rejected: r.ghostEvents });
  const redis = new Redis(inject('redisUrl'));
  onTestFinished(() => redis.quit().then(() => undefined));
  const aside = Object.values(await redis.hgetall(subjectKey.eventsRejected(r.ghostSubject.name))).map(
    (v) => JSON.parse(v) as { reason: string; event: { subject: string } },
  );
  expect(aside.length).toBe(r.ghostEvents);
  for (const a of aside) expect(a).toMatchObject({ reason: NO_CUSTOMER, event: { subject: r.ghost.id } });
  expect(await metric(r.gw, 'gateway_usage_events_rejected_total')).toBe(r.ghostEvents);
  // The period's statement holds what the biller took: shop's units net of refunds, none of ghost's set-aside events.
  const tallied = async (name: string, figure: string) =>
    Object.entries(await redis.hgetall(subjectKey.statements(name)))
      .filter(([f]) => f.endsWith(`|${figure}`))
      .reduce((n, [, v]) => n + Number(v), 0);
  expect(await tallied(r.ghostSubject.name, 'events')).toBe(0);
  expect(await tallied(r.shopSubject.name, 'units')).toBe(r.delivered);
}

const gated = () => {
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  return { gate, release };
};

describe('usage export in the stripe format', () => {
  it("meters every request's units once through redeliveries; Stripe's 400 duplicate counts as delivered", async () => {
    const stripe = await startStripe(['cus_shop']);
    const g = gated();
    stripe.state.gate = g.gate;
    stripe.state.failAfterKeeping = 3;
    const r = await run('stripe', stripe.url, g);
    expect(stripe.state.invalid).toEqual([]);
    expect(stripe.state.duplicates).toBeGreaterThan(0);
    // Held events of a resend that then failed are counted again on the next: at most what Stripe named.
    expect(await metric(r.gw, 'gateway_usage_events_duplicate_total')).toBeGreaterThan(0);
    expect(await metric(r.gw, 'gateway_usage_events_duplicate_total')).toBeLessThanOrEqual(stripe.state.duplicateEvents);
    // The SUM meter nets each refund (value "-1"): exactly the units delivered.
    expect(stripe.meter.get('cus_shop')).toBe(r.delivered);
    expect([...stripe.meter.keys()]).toEqual(['cus_shop']);
    expect(stripe.kept.size).toBe(r.shopEvents);
    // At the shipped batchSize (500) a POST would carry all the events waiting at the release.
    expect(Math.max(...stripe.state.sizes)).toBeLessThanOrEqual(100);
    // Every POST names the API version our bodies are written for (the pinned SDK's), not the account's default.
    expect(new Set(stripe.state.versions)).toEqual(new Set([STRIPE_API_VERSION]));
    await checkAccounts(r);
  });
});

describe('usage export in the lago format', () => {
  it('lands the new events of a batch Lago refuses whole for a seen transaction_id; its meter equals the units', async () => {
    const lago = await startLago();
    const g = gated();
    lago.state.gate = g.gate;
    // Kept in part, then 503 (lago-api before #4772 kept the rest of a refused batch): the resend mixes seen and new.
    lago.state.failAfterKeeping = 3;
    lago.state.keepHalf = true;
    const r = await run('lago', lago.url, g);
    expect(lago.state.invalid).toEqual([]);
    expect(lago.state.duplicates).toBeGreaterThan(0);
    expect(await metric(r.gw, 'gateway_usage_events_duplicate_total')).toBeGreaterThan(0);
    expect(await metric(r.gw, 'gateway_usage_events_duplicate_total')).toBeLessThanOrEqual(lago.state.duplicateEvents);
    expect(lago.meter.get('cus_shop')).toBe(r.delivered);
    expect([...lago.meter.keys()]).toEqual(['cus_shop']);
    expect(lago.kept.size).toBe(r.shopEvents);
    expect(Math.max(...lago.state.sizes)).toBeLessThanOrEqual(100);
    expect(new Set(lago.state.versions)).toEqual(new Set([undefined]));
    await checkAccounts(r);
  });

  it('waits the X-RateLimit-Reset of a 429 before the next POST', async () => {
    const lago = await startLago();
    lago.state.answer = { status: 429, headers: { 'x-ratelimit-reset': '2' } };
    const key = makeKey('metered');
    const gw = await buildTestGateway({
      config: testConfig([key], {
        plans,
        usage: { export: { url: lago.url, maxEvents: 1_000_000, batchSize: 500, format: 'lago', customers: { [key.id]: 'sub_1' } } },
      }),
    });
    onTestFinished(() => gw.close());
    await (await call(`${gw.url}/v1/pets`, key.key)).arrayBuffer();
    await eventually(() => lago.kept.size === 1, 20_000, 'the event at Lago');
    const [refused, next] = lago.state.times;
    // Without the header the first retry comes within 500 ms (leader.ts's backoff).
    expect(next! - refused!).toBeGreaterThanOrEqual(1900);
  });
});

describe("Stripe's backdate window", () => {
  it('sets an event older than 35 days aside without a POST; a 34-day-old one goes', async () => {
    const stripe = await startStripe(['cus_shop']);
    const sink = stripeSink(stripe.url);
    const day = 24 * 3600 * 1000;
    const event = (id: string, ageMs: number) => usageEvent(id, { ageMs, units: 3 });
    // An id over Stripe's 100 characters goes as a stable digest of it.
    const long = `shop/${'9'.repeat(120)}`;
    const old = event('shop/1-0', 36 * day);
    const answer = await sink.deliver([old, event('shop/2-0', 34 * day), event(long, 0)], new AbortController().signal);
    expect(answer).toEqual({ accepted: 'all', setAside: [{ event: old, reason: TOO_OLD }] });
    expect(stripe.state.posts).toBe(1);
    expect([...stripe.kept.keys()]).toEqual(['shop/2-0', expect.stringMatching(/^sha256-[A-Za-z0-9_-]{43}$/)]);
    expect(stripe.meter.get('cus_shop')).toBe(6);
    // The same long id again, from another instance's sink (a new leader), is the same identifier: Stripe's duplicate, delivered.
    const next = stripeSink(stripe.url);
    expect(await next.deliver([event(long, 0)], new AbortController().signal)).toEqual({ accepted: 'all', held: 1 });
    expect(stripe.state.duplicates).toBe(1);
  });
});

describe('a batch sent again', () => {
  it('costs no POST for the events the biller is known to hold: a round that failed after they landed sends them again', async () => {
    const stripe = await startStripe(['cus_shop']);
    const sink = stripeSink(stripe.url);
    const batch = Array.from({ length: 80 }, (_, i) => usageEvent(`shop/7-${i}`));
    const signal = new AbortController().signal;
    // Kept, its answer lost (the connection dropped): sent again at once, Stripe names one held
    // event a refusal, one of the POST whose answer was lost, so that POST was taken whole: its 80 held.
    stripe.state.fault = () => (stripe.state.posts === 1 ? 'lose' : undefined);
    expect(await sink.deliver(batch, signal)).toEqual({ accepted: 'all', held: 80 });
    expect({ posts: stripe.state.posts, duplicates: stripe.state.duplicates }).toEqual({ posts: 2, duplicates: 1 });
    // Sent again with 20 new events (the round failed later, on another batch): the 20 new alone.
    const more = [...batch, ...Array.from({ length: 20 }, (_, i) => usageEvent(`shop/8-${i}`))];
    expect(await sink.deliver(more, signal)).toEqual({ accepted: 'all' });
    expect(stripe.state.posts).toBe(3);
    // A third time: no POST at all.
    expect(await sink.deliver(more, signal)).toEqual({ accepted: 'all' });
    expect(stripe.state.posts).toBe(3);
    expect(stripe.meter.get('cus_shop')).toBe(100);
  });

  it('takes a held event named by Stripe for its own alone when it went in two unanswered POSTs: the other may never have arrived', async () => {
    const stripe = await startStripe(['cus_shop']);
    const sink = stripeSink(stripe.url);
    const signal = new AbortController().signal;
    const first = Array.from({ length: 30 }, (_, i) => usageEvent(`shop/7-${i}`));
    const more = [...first, ...Array.from({ length: 30 }, (_, i) => usageEvent(`shop/8-${i}`))];
    // The first 30 kept, their answer lost; then every POST lost on its way in (kept nowhere), the
    // first 30 sent again (three times, at once) and then all 60 (four times).
    stripe.state.fault = () => (stripe.state.posts === 1 ? 'lose' : stripe.state.posts <= 8 ? 'drop' : undefined);
    expect((await sink.deliver(first, signal)).accepted).toBe('none');
    expect((await sink.deliver(more, signal)).accepted).toBe('none');
    // Stripe names one of the first 30 held: the first POST took it, no later one took anything, so the 30 new go.
    expect((await sink.deliver(more, signal)).accepted).toBe('all');
    expect(stripe.meter.get('cus_shop')).toBe(60);
  });

  it('takes no POST of a new lead as held for an event written before the lead began: an earlier leader may have sent it', async () => {
    const stripe = await startStripe(['cus_shop']);
    const signal = new AbortController().signal;
    // Written at Redis ms 7 and 8; the earlier lead began at 5, the new one at 1,000.
    const first = Array.from({ length: 10 }, (_, i) => usageEvent(`shop/7-${i}`));
    const more = [...first, ...Array.from({ length: 10 }, (_, i) => usageEvent(`shop/8-${i}`))];
    // The earlier leader's first POST kept, its answer lost, the three it sent again at once lost on their way in.
    stripe.state.fault = () => (stripe.state.posts === 1 ? 'lose' : stripe.state.posts <= 4 ? 'drop' : undefined);
    expect((await stripeSink(stripe.url).deliver(first, signal, 5)).accepted).toBe('none');
    // The new leader's: the same and 10 new, its answer lost (Stripe refused it whole: it held the
    // first 10), sent again at once: Stripe names one of the first 10 held, which the earlier
    // leader's POST may have delivered, so the new leader's first POST tells nothing.
    stripe.state.fault = () => (stripe.state.posts === 5 ? 'lose' : undefined);
    expect((await stripeSink(stripe.url).deliver(more, signal, 1000)).accepted).toBe('all');
    expect(stripe.meter.get('cus_shop')).toBe(20);
  });
});

describe("Stripe's API version", () => {
  it('is the one usage.export.headers names, when it names one, sent once', async () => {
    const stripe = await startStripe(['cus_shop']);
    // An account that pins its own (any case of the name): ours must not go beside it (Node would join the two).
    const sink = stripeSink(stripe.url, { 'Stripe-Version': '2025-03-31.basil' });
    const event = usageEvent('shop/1-0');
    expect(await sink.deliver([event], new AbortController().signal)).toEqual({ accepted: 'all' });
    expect(stripe.state.versions).toEqual(['2025-03-31.basil']);
  });
});
