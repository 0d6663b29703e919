import { createHash } from 'node:crypto';
import { Ajv2020 } from 'ajv/dist/2020.js';
import formats from 'ajv-formats';
import type { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, inject, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { pricesKey, subjectKey } from '../../gateway/redis/keys.js';
import {
  CLOSE_RETRY_MS,
  defineCloseScripts,
  duePeriods,
  freeze,
  notePrices,
  notYet,
  periodsTouched,
  pricesAt,
} from '../../gateway/usage/closes.js';
import { pricesInForce } from '../../gateway/usage/prices.js';
import { defineCursorScripts, moveUsageCursor } from '../../gateway/usage/cursors.js';
import { REFUND_TYPE } from '../../gateway/usage/events.js';
import { SETTLE_MS } from '../../gateway/usage/exporter.js';
import { adminCall } from '../helpers/admin.js';
import { expectAccessible, freshPage, launch } from '../helpers/browser.js';
import { call, callDecided, makeKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildInstances, buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { spawnRedis, testClient } from '../helpers/redis.js';
import { shiftedEnv } from '../helpers/shifted-clock.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';

// Billing periods at the sink (issue 49): each exported event tallied into its period as its
// cursor moves; a period that ended closes with one period.closed event whose figures and digest
// equal what the sink holds; the statement equals the sink and the month's count; an event of a
// closed period that comes late goes into the next as a correction.
//
// A billing-day boundary is not waited for here: the previous period's events are written into the
// account's stream as an instance wrote them then (quota.lua's and refund.lua's fields, their
// stream ids at their time), as billing.test seeds a past period's count. export-faults.test.ts
// (TEST_FULL_SIZE) runs traffic across one, on a clock shifted to just before it.

const TOKEN = 'admin-token-0123456789';
const CLOSED = 'com.petstore.gateway.period.closed';
const plans: ConfigFile['plans'] = {
  metered: { perMinute: 100_000, perDay: 1_000_000, perMonth: 10_000_000, prices: { currency: 'EUR', unit: '0.0125' } },
};

/** 00:00 UTC of billing day `day` in month `month` (0-based, may run over), a day past the month's end its last: the calendar, not period.ts. */
const dayIn = (year: number, month: number, day: number) =>
  Date.UTC(year, month, Math.min(day, new Date(Date.UTC(year, month + 1, 0)).getUTCDate()));

/** The test's own digest: the sum of SHA-256("<id> <units>") mod 2^256, as docs/operators.md tells a biller to compute it. */
function digest(events: ReadonlyArray<{ id: string; units: number }>): string {
  let sum = 0n;
  for (const e of events) sum += BigInt(`0x${createHash('sha256').update(`${e.id} ${e.units}`).digest('hex')}`);
  return (sum % (1n << 256n)).toString(16).padStart(64, '0');
}

const iso = (ms: number) => new Date(ms).toISOString();

/** A request's entry as quota.lua writes it into an account's stream, stamped `at` (`id`: `<at>-0`, or `*` for one written now). */
const seedRequest = (
  redis: Redis,
  stream: string,
  id: string,
  at: number,
  r: { rid: string; key: string; route?: string; units?: number },
) =>
  redis.xadd(
    stream,
    id,
    ...['kind', 'request', 'rid', r.rid, 'key', r.key, 'plan', 'metered', 'route', r.route ?? 'listPets', 'method', 'GET'],
    ...['units', String(r.units ?? 1), 'at', String(at), 'minute', '1', 'day', '1', 'month', '1'],
    ...['overage', '0', 'credits', '-1', 'status', '200'],
  );

type Sunk = { id: string; type: string; time: string; data: Record<string, unknown>; correctionof?: string; originaltime?: string };

describe('a billing period closed at the sink', () => {
  let sink: Awaited<ReturnType<typeof startSink>>;
  let gateways: TestGateway[];
  let redis: Redis;
  const account = `acct${Date.now().toString(36)}`;
  const key = { ...makeKey('metered'), account };
  const today = new Date();
  const billingDay = today.getUTCDate();
  const currentStart = dayIn(today.getUTCFullYear(), today.getUTCMonth(), billingDay);
  const previousStart = dayIn(today.getUTCFullYear(), today.getUTCMonth() - 1, billingDay);
  const sunk = () => [...sink.events.values()] as unknown as Sunk[];
  const usage = (e: Sunk) => e.type.startsWith('com.petstore.gateway.request');
  const statement = async (g: TestGateway, period: string) =>
    (await adminCall(g, TOKEN, `/admin/accounts/${account}/statements/${period}`)).json();
  const configAt = (p: ConfigFile['plans']) =>
    testConfig([key], {
      plans: p,
      accounts: { [account]: { billingDay } },
      // The statement routes, the document and the portal's pages count on the per-address quota: more than testConfig's 4 a minute here.
      unauthenticated: { perMinute: 1000 },
      usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } },
    });

  beforeAll(async () => {
    sink = await startSink();
    redis = testClient(inject('redisUrl'));
    ({ instances: gateways } = await buildInstances(3, {
      config: configAt(plans),
      admin: { token: TOKEN },
      backend: 'pets', // its document: the gateway's is made from it
    }));
  });
  afterAll(async () => {
    for (const g of gateways) await g.close();
    await sink.close();
    redis.disconnect();
  });

  it('closes the previous period once its events are at the sink; its statement, the close event and the sink agree; the current one equals the month', async () => {
    const name = gateways[0]!.gateway.config().accounts.get(account)!.name;
    const stream = subjectKey.events(name);
    // The previous period, as the instances wrote it: three requests (one of a route costing 5), a
    // refund of the second (its backend failed), a top-up.
    const seeded: Array<[number, string, number]> = [
      [4, 'listPets', 1],
      [3, 'listPets', 1],
      [2, 'createPet', 5],
    ];
    const ids: string[] = [];
    for (const [hoursBefore, route, units] of seeded) {
      const at = currentStart - hoursBefore * 3_600_000;
      ids.push((await seedRequest(redis, stream, `${at}-0`, at, { rid: `seed-${hoursBefore}`, key: key.id, route, units }))!);
    }
    const refundAt = currentStart - 3_600_000;
    const refund = [
      'kind',
      'refund',
      'ref',
      ids[1]!,
      'units',
      '1',
      'overage',
      '0',
      'at',
      String(refundAt),
      'plan',
      'metered',
      'route',
      'listPets',
    ];
    await redis.xadd(stream, `${refundAt}-0`, ...refund);
    const topUpAt = currentStart - 1_800_000;
    await redis.xadd(
      stream,
      `${topUpAt}-0`,
      'kind',
      'credits',
      'entry',
      'topup',
      'ledger',
      `${topUpAt}-0`,
      'at',
      String(topUpAt),
      'amount',
      '50',
      'balance',
      '50',
      'reason',
      'seeded',
      'idempotencyKey',
      'seed-1',
    );

    // The current period: traffic through two instances; the first only leads the export.
    let sent = 0;
    let unavailable = 0;
    for (let i = 0; i < 40; i++) {
      const res = await callDecided(`${gateways[1 + (i % 2)]!.url}${i % 4 === 3 ? '/v1/nope' : '/v1/pets'}`, key.key);
      expect([200, 404], res.body).toContain(res.status);
      unavailable += res.unavailable;
      sent++;
    }
    if (unavailable > 0) console.log(`${unavailable} answers 503 quota_store_unavailable (a reply past REDIS_TIMEOUT_MS), asked again`);
    const closeId = `${account}/period/${iso(previousStart)}`;
    await eventually(() => sink.events.has(closeId), 30_000, 'the previous period closed');
    for (const g of gateways.slice(1)) await g.close();
    // A 503 whose call Redis did count is refunded: a request and its refund, both at the sink.
    const refunds = () => sunk().filter((e) => e.type === REFUND_TYPE && Date.parse(e.time) >= currentStart).length;
    await eventually(() => sunk().filter(usage).length === 4 + sent + 2 * refunds(), 30_000, 'every event at the sink');
    const undone = refunds();
    expect(undone).toBeLessThanOrEqual(unavailable);

    const previous = sunk().filter((e) => usage(e) && Date.parse(e.time) < currentStart);
    const close = sink.events.get(closeId)! as unknown as Sunk;
    expect(close.type).toBe(CLOSED);
    expect(close.data).toEqual({
      period: { start: iso(previousStart), end: iso(currentStart) },
      requests: 3,
      units: 6,
      refunds: { events: 1, units: 1 },
      overage: 0,
      corrections: 0,
      credits: { granted: 0, purchased: 50, applied: { granted: 0, purchased: 0 }, returned: 0 },
      events: 4,
      digest: { algorithm: 'sha256-sum', value: digest(previous.map((e) => ({ id: e.id, units: Number(e.data.units) }))) },
    });
    expect(previous.reduce((n, e) => n + Number(e.data.units), 0)).toBe(6);
    // Marked closed once the leader has the sink's answer, a moment after the sink has the event.
    await eventually(
      async () => (await statement(gateways[0]!, iso(previousStart).slice(0, 10))).status === 'closed',
      30_000,
      'marked closed',
    );
    const last = await statement(gateways[0]!, iso(previousStart).slice(0, 10));
    expect(last).toMatchObject({ account, billingDay, status: 'closed', period: close.data.period, events: 4, digest: close.data.digest });
    // Priced at the plan's 0.0125 a unit: 5 units, 0.0625; two requests less one refunded, 0.0125.
    const price = { unit: '0.0125', overage: '0.0125' };
    expect({ currency: last.currency, lines: last.lines, amount: last.totals.amount }).toEqual({
      currency: 'EUR',
      lines: [
        { plan: 'metered', route: 'createPet', requests: 1, refunds: 0, units: 5, included: 5, overage: 0, price, amount: '0.0625' },
        { plan: 'metered', route: 'listPets', requests: 2, refunds: 1, units: 1, included: 1, overage: 0, price, amount: '0.0125' },
      ],
      amount: '0.075',
    });

    // The current period, three ways: the statement, the sink's SUM of units, the month's count.
    const current = sunk().filter((e) => usage(e) && Date.parse(e.time) >= currentStart);
    const now = await statement(gateways[0]!, 'current');
    const month = await (await adminCall(gateways[0]!, TOKEN, `/admin/accounts/${account}/usage`)).json();
    // A lease's units not handed out stay counted and unsettled (docs/reference.md, "Usage export at lease speed").
    expect(month.events.pending).toBe(0);
    expect({
      statement: now.totals.units,
      sink: current.reduce((n, e) => n + Number(e.data.units), 0),
      month: month.windows.month.used - month.events.unsettled,
    }).toEqual({ statement: sent, sink: sent, month: sent });
    expect(now).toMatchObject({
      status: 'open',
      events: sent + 2 * undone,
      totals: { requests: sent + undone },
      digest: { value: digest(current.map((e) => ({ id: e.id, units: Number(e.data.units) }))) },
    });
    expect(sent).toBe(40);
    expect(now.totals.amount).toBe('0.5'); // 40 units at 0.0125
    // The public route gives the key's own account the same statement.
    const own = await call(`${gateways[0]!.url}/v1/me/statements/current`, key.key);
    expect(own.status).toBe(200);
    const body = await own.json();
    expect(body).toEqual(now);
    // As the public document says (ajv, not our code): gateway-openapi.test.ts drives the route's other answers.
    const doc = await (await call(`${gateways[0]!.url}/v1/openapi.json`)).json();
    const ajv = new Ajv2020({ strict: false });
    formats.default(ajv);
    const valid = ajv.addSchema(doc, 'api').getSchema('api#/components/schemas/Statement')!;
    expect(valid(body), JSON.stringify(valid.errors)).toBe(true);
    // The portal shows the key's account the same period, read by the same code, in a real browser.
    const browser = await launch();
    try {
      const { page } = await freshPage(browser);
      await page.goto(`${gateways[0]!.url}/portal`);
      await page.fill('input[name="key"]', key.key);
      await page.click('button[type="submit"]');
      const table = page.locator('[data-statement]');
      await table.waitFor();
      const shown = { units: await table.getAttribute('data-units'), events: await table.getAttribute('data-events') };
      expect(shown).toEqual({ units: String(now.totals.units), events: String(now.events) });
      expect(await table.locator('tfoot td').first().textContent()).toBe(String(now.totals.requests));
      // No refund this period (unless a 503 undid a counted call), and the amount the API gives, in the plan's currency.
      expect(await table.locator('tfoot td').nth(1).textContent()).toBe(String(undone));
      expect(await table.locator('thead th').last().textContent()).toBe('Amount (EUR)');
      expect(await table.locator('[data-amount]').textContent()).toBe(now.totals.amount);
      await expectAccessible(page, 'the portal with a statement');
    } finally {
      await browser.close();
    }
    // The price raised since: the closed period stays as it was billed (priced as at its end:
    // it ended before the first note, so by the first); the open one at the new.
    gateways[0]!.load(configAt({ metered: { ...plans.metered!, prices: { currency: 'EUR', unit: '0.02' } } }));
    onTestFinished(() => gateways[0]!.load(configAt(plans)));
    const notes = pricesKey(gateways[0]!.gateway.config().redisPrefix);
    await eventually(async () => (await redis.zcard(notes)) === 2, 10_000, 'the new prices noted by the exporting leader');
    expect((await statement(gateways[0]!, iso(previousStart).slice(0, 10))).totals.amount).toBe('0.075');
    expect((await statement(gateways[0]!, 'current')).totals.amount).toBe('0.8'); // 40 units at 0.02
  });

  it('sends an event of the closed period that comes late into the current one, flagged, and leaves the closed one as it was', async () => {
    const name = gateways[0]!.gateway.config().accounts.get(account)!.name;
    const at = currentStart - 600_000;
    const before = await statement(gateways[0]!, 'previous');
    const now = await statement(gateways[0]!, 'current');
    // Written now (its batch was held up), stamped in the previous period.
    await seedRequest(redis, subjectKey.events(name), '*', at, { rid: 'late-1', key: key.id });
    await call(`${gateways[0]!.url}/v1/pets`, key.key); // marks the account for the export
    await eventually(() => sunk().some((e) => e.data.requestId === 'late-1'), 30_000, 'the late event at the sink');
    const late = sunk().find((e) => e.data.requestId === 'late-1')!;
    expect({ time: late.time, correctionof: late.correctionof, originaltime: late.originaltime }).toEqual({
      time: iso(currentStart),
      correctionof: iso(previousStart),
      originaltime: iso(at),
    });
    await eventually(async () => (await statement(gateways[0]!, 'current')).events === now.events + 2, 30_000, 'both tallied');
    const after = await statement(gateways[0]!, 'current');
    expect(after.totals).toMatchObject({ corrections: 1, units: now.totals.units + 2 });
    expect(await statement(gateways[0]!, 'previous')).toEqual(before);
    expect(sunk().filter((e) => e.type === CLOSED)).toHaveLength(1);
  });
});

describe('a sink that refuses the close events', () => {
  it('holds up the closes alone: the events behind them go on, no round fails, and the period closes once it takes them', async () => {
    const sink = await startSink();
    const redis = testClient(inject('redisUrl'));
    const account = `refuser${Date.now().toString(36)}`;
    const key = { ...makeKey('metered'), account };
    const today = new Date();
    const billingDay = today.getUTCDate();
    const currentStart = dayIn(today.getUTCFullYear(), today.getUTCMonth(), billingDay);
    const gw = await buildTestGateway({
      config: testConfig([key], {
        plans,
        accounts: { [account]: { billingDay } },
        unauthenticated: { perMinute: 1000 }, // the statement reads below count per address
        usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } },
      }),
      admin: { token: TOKEN },
    });
    try {
      const name = gw.gateway.config().accounts.get(account)!.name;
      const at = currentStart - 3_600_000;
      await seedRequest(redis, subjectKey.events(name), `${at}-0`, at, { rid: 'seed', key: key.id });
      sink.state.fault = (events) => (events?.some((e) => e.type === CLOSED) ? 'fail' : undefined);
      const previous = async () => (await adminCall(gw, TOKEN, `/admin/accounts/${account}/statements/previous`)).json();
      for (let i = 0; i < 10; i++) expect((await call(`${gw.url}/v1/pets`, key.key)).status).toBe(200);
      await eventually(async () => (await previous()).status === 'closing', 30_000, 'the previous period frozen, its close refused');
      await gw.waitForLog((l) => String(l.msg).includes('close events; they are sent again'));
      // Events sent while the closes are refused all reach the sink, and no round failed for it.
      for (let i = 0; i < 10; i++) expect((await call(`${gw.url}/v1/pets`, key.key)).status).toBe(200);
      await eventually(() => sink.requests().length === 21, 30_000, 'every request event at the sink');
      const failures = await gw.gateway.metrics.registry.getSingleMetricAsString('gateway_usage_export_failures_total');
      expect(Number(/ (\d+)$/m.exec(failures)?.[1])).toBe(0);
      expect((await previous()).status).toBe('closing');
      sink.state.fault = undefined;
      await eventually(async () => (await previous()).status === 'closed', 40_000, 'closed once the sink takes it');
      expect(sink.events.has(`${account}/period/${iso(dayIn(today.getUTCFullYear(), today.getUTCMonth() - 1, billingDay))}`)).toBe(true);
    } finally {
      await gw.close();
      await sink.close();
      redis.disconnect();
    }
  });
});

describe('a gateway host whose clock is behind Redis', () => {
  it("closes a period that ended by Redis's clock, though not yet by its own; its statement is the previous one", async () => {
    // Redis two days ahead (shifted-clock.ts); the accounts' billing day is tomorrow's by this
    // host: by Redis's clock, which stamps the events, the period ending then has ended.
    const server = await spawnRedis({ env: await shiftedEnv(2 * 86_400_000) });
    onTestFinished(() => server.stop());
    const redis = testClient(server.url);
    onTestFinished(() => void redis.disconnect());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const account = `behind${Date.now().toString(36)}`;
    const key = { ...makeKey('metered'), account };
    const today = new Date();
    const end = Date.UTC(today.getUTCFullYear(), today.getUTCMonth(), today.getUTCDate() + 1);
    const billingDay = new Date(end).getUTCDate();
    const start = dayIn(new Date(end).getUTCFullYear(), new Date(end).getUTCMonth() - 1, billingDay);
    const gw = await buildTestGateway({
      config: testConfig([key], {
        plans,
        accounts: { [account]: { billingDay } },
        usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } },
      }),
      redis: server.url,
      admin: { token: TOKEN },
    });
    onTestFinished(() => gw.close());
    const at = end - 3_600_000;
    await seedRequest(redis, subjectKey.events(gw.gateway.config().accounts.get(account)!.name), `${at}-0`, at, {
      rid: 'seed',
      key: key.id,
    });
    expect((await call(`${gw.url}/v1/pets`, key.key)).status).toBe(200); // its account is then the export's to read
    await eventually(() => sink.events.has(`${account}/period/${iso(start)}`), 30_000, "the period closed by Redis's clock");
    // Its statement is the previous one; the current one is the period open by Redis's clock.
    const of = async (period: string) => (await adminCall(gw, TOKEN, `/admin/accounts/${account}/statements/${period}`)).json();
    // Marked closed once the leader has the sink's answer, a moment after the sink has the event (CI, 2026-11-29: 'closing').
    await eventually(async () => (await of('previous')).status === 'closed', 30_000, 'marked closed');
    expect(await of('previous')).toMatchObject({ status: 'closed', period: { start: iso(start), end: iso(end) }, totals: { units: 1 } });
    await eventually(async () => (await of('current')).totals.units === 1, 30_000, "the request's event in the current period");
    expect(await of('current')).toMatchObject({ status: 'open', period: { start: iso(end) } });
  });
});

describe('freezing a period', () => {
  let redis: Redis;
  const prefix = uniquePrefix();
  let serial = 0;
  beforeAll(() => {
    redis = testClient(inject('redisUrl'));
    defineCloseScripts(redis);
    defineCursorScripts(redis);
  });
  afterAll(() => redis.disconnect());

  const redisNow = async () => {
    const [s, us] = await redis.time();
    return Number(s) * 1000 + Math.floor(Number(us) / 1000);
  };
  /** A period of a fresh account that ended `agoMs` ago (Redis's time), with the shipped settle. */
  async function ended(agoMs: number) {
    const name = `${prefix}:{k:a${++serial}}`;
    const end = (await redisNow()) - agoMs;
    const d = { name, startMs: end - 30 * 86_400_000, endMs: end };
    return { name, end, try: (token = 1) => freeze(redis, d, token, SETTLE_MS) };
  }

  it("is priced by the prices noted last before its end (the first, if it ended before any); the same prices noted again write nothing; notes older than the statements' 400 days go, but for the last of them", async () => {
    const key = pricesKey(prefix);
    const [a, b] = ['0.1', '0.2'].map((unit) => pricesInForce({ pro: { prices: { currency: 'EUR', unit } }, free: {} }));
    const day = 86_400_000;
    const start = await redisNow();
    await redis.zadd(key, start - 500 * day, `${start - 500 * day}|old`, start - 450 * day, `${start - 450 * day}|older-kept`);
    await notePrices(redis, prefix, a!);
    await notePrices(redis, prefix, a!); // the same: nothing written
    const [, first] = (await redis.zrange(key, 0, -1, 'WITHSCORES')).slice(-2);
    while ((await redisNow()) <= Number(first)) await new Promise((r) => setTimeout(r, 1)); // a later ms in Redis's time
    await notePrices(redis, prefix, b!);
    const notes = await redis.zrange(key, 0, -1, 'WITHSCORES');
    expect(notes.filter((_, i) => i % 2 === 0).map((m) => m.slice(m.indexOf('|') + 1))).toEqual(['older-kept', a, b]);
    const second = Number(notes.at(-1));
    expect(await pricesAt(redis, prefix, second)).toBe(a); // ended just as b was noted: a's period
    expect(await pricesAt(redis, prefix, second + 1)).toBe(b);
    expect(await pricesAt(redis, prefix, start - 600 * day)).toBe('older-kept'); // before any note: the first
    expect(await pricesAt(redis, uniquePrefix(), second)).toBeUndefined();
  });

  it('waits for its end, then for its unsettled units until the settle has passed', async () => {
    const future = await ended(-60_000);
    expect(await future.try()).toBe('not yet');
    const p = await ended(1000);
    await redis.hset(subjectKey.eventsCursor(p.name), 'unsettled', 3);
    expect(await p.try()).toBe('not yet');
    await redis.hset(subjectKey.eventsCursor(p.name), 'unsettled', 0);
    expect(await p.try()).toBe('frozen');
    expect(await redis.hget(subjectKey.statements(p.name), 'frozen')).toBe(String(p.end));
    const lost = await ended(SETTLE_MS + 1000); // an instance died with its units: they never come
    await redis.hset(subjectKey.eventsCursor(lost.name), 'unsettled', 3);
    expect(await lost.try()).toBe('frozen');
  });

  it('waits while an unsent entry holds an event from before its end, or a bundle written before its end and the settle', async () => {
    const p = await ended(SETTLE_MS + 1000);
    const id = await redis.xadd(subjectKey.events(p.name), `${p.end - 5}-0`, 'kind', 'request', 'at', String(p.end - 5));
    expect(await p.try()).toBe('not yet');
    await redis.xdel(subjectKey.events(p.name), id!);
    await redis.xadd(subjectKey.events(p.name), '*', 'kind', 'request', 'at', String(p.end + 5));
    // A bundle's events are its instance's of the settle before it was written: one written 30 s after the end may hold the period's.
    const bundle = ['n', '1', 'upto', '1', 'data', '', 'refunds', ''];
    const b = await redis.xadd(subjectKey.bundles(p.name), `${p.end + 30_000}-0`, ...bundle);
    expect(await p.try()).toBe('not yet');
    await redis.xdel(subjectKey.bundles(p.name), b!);
    await redis.xadd(subjectKey.bundles(p.name), '*', ...bundle);
    expect(await p.try()).toBe('frozen');
  });

  it('tries a period not ready again later, so the ones behind it get their turn', async () => {
    const own = `${prefix}x${++serial}`;
    const now = await redisNow();
    const [a, b] = [1, 2].map((i) => ({ name: `${own}:{k:a${i}}`, startMs: now - 40 * 86_400_000 + i, endMs: now - 10 * 86_400_000 + i }));
    await periodsTouched(redis, own, [a!, b!]);
    expect((await duePeriods(redis, own, now)).map((d) => d.name)).toEqual([a!.name, b!.name]);
    await notYet(redis, own, a!, now, SETTLE_MS);
    expect(await duePeriods(redis, own, now)).toEqual([b]);
    // Touched again by a round, it keeps its next try.
    await periodsTouched(redis, own, [a!]);
    expect(await duePeriods(redis, own, now)).toEqual([b]);
  });

  it('tries a period waiting on its settle again when the settle ends, not a whole wait later', async () => {
    const own = `${prefix}x${++serial}`;
    const now = await redisNow();
    // Ended 52 s ago with units unsettled: its settle ends in 3 s, before NOT_YET_MS (5 s) would try it.
    const d = { name: `${own}:{k:a1}`, startMs: now - 30 * 86_400_000, endMs: now - (SETTLE_MS - 3000) };
    await periodsTouched(redis, own, [d]);
    await notYet(redis, own, d, now, SETTLE_MS);
    expect(await duePeriods(redis, own, now + 2999)).toEqual([]);
    expect(await duePeriods(redis, own, now + 3000)).toEqual([d]);
    // Just past its settle, still not ready (its last bundle goes in the next round): tried every round, not 5 s later.
    const past = { name: `${own}:{k:a2}`, startMs: d.startMs, endMs: now - SETTLE_MS - 1000 };
    await periodsTouched(redis, own, [past]);
    await notYet(redis, own, past, now, SETTLE_MS);
    expect(await duePeriods(redis, own, now + CLOSE_RETRY_MS)).toEqual([past]);
  });

  it('is fenced as the cursor is: a deposed leader freezes nothing', async () => {
    const p = await ended(SETTLE_MS + 1000);
    await redis.hset(subjectKey.eventsCursor(p.name), 'fence', 5);
    expect(await p.try(4)).toBe('fenced');
    expect(await redis.exists(subjectKey.statements(p.name))).toBe(0);
    expect(await p.try(5)).toBe('frozen');
  });

  it('a move tallies a bundle once, whichever leader moves it, and nothing against a freeze it did not read', async () => {
    const name = `${prefix}:{k:a${++serial}}`;
    const line = (upto: number, units: number, hex: string) => `${upto} 0|units ${units} 0|digest ${hex}`;
    const h1 = createHash('sha256').update('x 1').digest('hex');
    const h2 = createHash('sha256').update('y 1').digest('hex');
    const bundle = (upto: number) => ({ id: `${upto}-0`, upto });
    expect(
      await moveUsageCursor(redis, name, { token: 1, from: '0-0', consumed: 0, refs: [], bundle: bundle(1), stats: [line(1, 1, h1)] }),
    ).toBe('moved');
    // A second leader sent bundles 1 and 2 again: only the second is tallied.
    expect(
      await moveUsageCursor(redis, name, {
        token: 2,
        from: '0-0',
        consumed: 0,
        refs: [],
        bundle: bundle(2),
        stats: [line(1, 1, h1), line(2, 1, h2)],
      }),
    ).toBe('moved');
    const hash = await redis.hgetall(subjectKey.statements(name));
    expect(hash['0|units']).toBe('2');
    expect(hash['0|digest']).toBe(((BigInt(`0x${h1}`) + BigInt(`0x${h2}`)) % (1n << 256n)).toString(16).padStart(64, '0'));
    // Bundles 3 and 4 sent, then dropped by the stream's cap before the move (usagebatch.lua moves bupto past them and
    // counts them dropped): still tallied, and exported, not dropped, in the reconcile.
    await redis.hset(subjectKey.eventsCursor(name), 'bupto', 4, 'bdropped', 2);
    expect(
      await moveUsageCursor(redis, name, {
        token: 2,
        from: '0-0',
        consumed: 0,
        refs: [],
        bundle: bundle(4),
        bundleFrom: 2,
        stats: [line(3, 1, h1), line(4, 1, h1)],
      }),
    ).toBe('moved');
    expect((await redis.hgetall(subjectKey.statements(name)))['0|units']).toBe('4');
    const reconciled = async () => (await redis.hmget(subjectKey.eventsCursor(name), 'bconsumed', 'bdropped')).map(Number);
    expect(await reconciled()).toEqual([4, 0]);
    // Bundles 5 to 10 dropped before any round read them: dropped they stay.
    await redis.hset(subjectKey.eventsCursor(name), 'bupto', 10, 'bdropped', 6);
    expect(
      await moveUsageCursor(redis, name, {
        token: 2,
        from: '0-0',
        consumed: 0,
        refs: [],
        bundle: bundle(11),
        bundleFrom: 10,
        stats: [line(11, 1, h1)],
      }),
    ).toBe('moved');
    expect(await reconciled()).toEqual([5, 6]);
    await redis.hset(subjectKey.statements(name), 'frozen', 7);
    expect(
      await moveUsageCursor(redis, name, { token: 2, from: '0-0', consumed: 0, refs: [], bundle: bundle(5), stats: [line(5, 9, h1)] }),
    ).toBe('raced');
    expect((await redis.hgetall(subjectKey.statements(name)))['0|units']).toBe('5');
  });
});

describe('the statements routes', () => {
  it('refuse a malformed period, an unknown account and a gateway that exports nothing, each in the Error shape', async () => {
    const key = makeKey('metered');
    const gw = await buildTestGateway({ config: testConfig([key], { plans }), admin: { token: TOKEN } });
    const bad = await call(`${gw.url}/v1/me/statements/2026-02-30`, key.key);
    expect({ status: bad.status, body: await bad.json() }).toMatchObject({ status: 400, body: { code: 'bad_request', status: 400 } });
    const off = await call(`${gw.url}/v1/me/statements/current`, key.key);
    expect(await off.json()).toMatchObject({ code: 'statements_not_enabled', status: 409 });
    const none = await adminCall(gw, TOKEN, '/admin/accounts/nobody/statements/current');
    expect(await none.json()).toMatchObject({ code: 'key_not_found', status: 404 });
    const unkeyed = await call(`${gw.url}/v1/me/statements/current`, 'psk_live_nope');
    expect(unkeyed.status).toBe(401);
    // A segment too long for the router's params is no statement, and never reaches the backend.
    for (const period of ['x'.repeat(65), 'x'.repeat(150)]) {
      const long = await call(`${gw.url}/v1/me/statements/${period}`, key.key);
      expect({ status: long.status, body: await long.json() }).toMatchObject({ status: 404, body: { code: 'route_not_found' } });
    }
    expect(gw.echo!.seen).toEqual([]);
  });
});
