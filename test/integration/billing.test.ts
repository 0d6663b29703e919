import { readFileSync } from 'node:fs';
import { parseList } from 'structured-headers';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { billingPeriod } from '../../gateway/quota/period.js';
import { call, makeKey, redisKeyOf, type TestKey, testConfig } from '../helpers/config.js';
import { buildInstances, buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { freePort } from '../helpers/net.js';
import { decidedByRedis, eventually } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

// Billing periods, prepaid credits and overage, decided in quota.lua: exact across three
// instances of one deployment at the shipped settings (leases on), with Redis's own time.

const ADMIN_TOKEN = 'admin-token-0123456789';
const DAY = 86_400_000;
/**
 * A billing day at least nine days from today's, either way (UTC): no period boundary falls
 * within a test run, whenever it runs.
 */
const BILLING_DAY = ((new Date().getUTCDate() + 10) % 28) + 1;
/** 00:00 UTC of day `day` of month `month` (0-based, carried over the year), clamped to the month's last day. */
const startOf = (year: number, month: number, day: number) => {
  const last = new Date(Date.UTC(year, month + 1, 0)).getUTCDate();
  return Date.UTC(year, month, Math.min(day, last));
};
/** The current period's bounds, worked out here from the calendar, not by the code under test. */
function currentPeriod(day: number, now = Date.now()): { start: number; end: number } {
  const d = new Date(now);
  let start = startOf(d.getUTCFullYear(), d.getUTCMonth(), day);
  let end = startOf(d.getUTCFullYear(), d.getUTCMonth() + 1, day);
  if (now < start) [start, end] = [startOf(d.getUTCFullYear(), d.getUTCMonth() - 1, day), start];
  return { start, end };
}

const plans: ConfigFile['plans'] = {
  monthly: { perMinute: 100_000, perDay: 1_000_000, perMonth: 30 },
  // 1,000 a month and 500 of overage: leases of 15 (1% of 1,500), never across the line at 1,000.
  metered: { perMinute: 100_000, perDay: 1_000_000, perMonth: 1000, overage: { upTo: 500 } },
  prepaid: { perMinute: 100_000, perDay: 1_000_000, credits: { grant: 20, every: 'month' } },
  topups: { perMinute: 100_000, perDay: 1_000_000, credits: { grant: 0, every: 'month' } },
  rolling: { perMinute: 100_000, perDay: 1_000_000, credits: { grant: 5, every: 'month', rollover: true } },
  movedmonth: { perMinute: 100_000, perDay: 1_000_000, perMonth: 1000, credits: { grant: 5, every: 'month' } },
  both: {
    perMinute: 100_000,
    perDay: 1_000_000,
    perMonth: 5,
    overage: { upTo: 2 },
    credits: { grant: 10, every: 'month', rollover: true },
  },
};

const keys = {
  monthly: makeKey('monthly'),
  metered: makeKey('metered'),
  prepaid: makeKey('prepaid'),
  topups: makeKey('topups'),
  racing: makeKey('topups'),
  rollover: makeKey('monthly'),
  granted: makeKey('prepaid'),
  idle: makeKey('rolling'),
  moved: makeKey('movedmonth'),
  viewer: makeKey('both'),
};
const accounts = Object.fromEntries(Object.values(keys).map((k) => [k.id, { billingDay: BILLING_DAY }]));

let gateways: TestGateway[] = [];
beforeAll(async () => {
  const config = testConfig(Object.values(keys), { plans, accounts });
  ({ instances: gateways } = await buildInstances(3, { config, admin: { token: ADMIN_TOKEN } }));
});
afterAll(async () => {
  for (const g of gateways) await g.close();
});

interface Answer {
  status: number;
  code?: string;
  headers: Headers;
}

/** `n` requests with `key`, alternated over the three instances, 50 in flight. */
async function burst(key: TestKey, n: number): Promise<Answer[]> {
  const answers: Answer[] = [];
  let next = 0;
  const worker = async () => {
    while (next < n) {
      const i = next++;
      const res = await call(`${gateways[i % 3]!.url}/v1/pets`, key.key);
      const body = res.status === 200 ? undefined : ((await res.json()) as { code: string });
      if (res.status === 200) await res.arrayBuffer();
      answers.push({ status: res.status, code: body?.code, headers: res.headers });
    }
  };
  await Promise.all(Array.from({ length: 50 }, worker));
  return answers;
}

/**
 * A burst of `n` with a key of `key`'s plan, decided by Redis throughout: a run during which an
 * instance stalled past REDIS_TIMEOUT_MS (a loaded machine) answers those keys 503 from its
 * degraded budget, as it should, and is run again with a fresh key of the plan, loaded into the
 * three instances as a reload would (the spent one's month and bans stay spent). `before` reads
 * what the run's assertions count from, before each run.
 */
async function exactBurst<T>(key: TestKey, n: number, before: () => Promise<T>): Promise<{ answers: Answer[]; key: TestKey; before: T }> {
  let current = key;
  return decidedByRedis(
    gateways,
    async () => {
      const at = await before();
      return { answers: await burst(current, n), key: current, before: at };
    },
    () => {
      current = makeKey(current.plan);
      extra.push(current);
      const config = testConfig([...Object.values(keys), ...extra], {
        plans,
        accounts: { ...accounts, [current.id]: { billingDay: BILLING_DAY } },
      });
      for (const g of gateways) g.load(config);
    },
  );
}
/** Keys a rerun added (exactBurst). */
const extra: TestKey[] = [];

const count = (answers: Answer[], status: number) => answers.filter((a) => a.status === status).length;
/** A counter's value summed over the three instances' /metrics (Prometheus text), 0 where absent. */
async function metric(series: string): Promise<number> {
  let sum = 0;
  for (const g of gateways) {
    const text = await (await fetch(`${g.adminUrl}/metrics`)).text();
    const line = text.split('\n').find((l) => l.startsWith(`${series} `));
    sum += line ? Number(line.split(' ')[1]) : 0;
  }
  return sum;
}
const admin = (i: number, path: string, init: RequestInit = {}) =>
  fetch(`${gateways[i]!.adminUrl}${path}`, { ...init, headers: { authorization: `Bearer ${ADMIN_TOKEN}`, ...init.headers } });
const topUp = (i: number, account: string, body: unknown, idempotencyKey: string) =>
  admin(i, `/admin/accounts/${account}/credits`, {
    method: 'POST',
    body: JSON.stringify(body),
    headers: { 'content-type': 'application/json', 'idempotency-key': idempotencyKey },
  });

describe('the billing period', () => {
  it('admits exactly the month across three instances, then 429 monthly_quota_exceeded until the period ends', async () => {
    const { answers, before } = await exactBurst(keys.monthly, 90, () => metric('gateway_rejections_total{reason="month"}'));
    expect({ admitted: count(answers, 200), refused: count(answers, 429) }).toEqual({ admitted: 30, refused: 60 });
    // Refused for the month three times; the fourth refusal within a minute bans (bans.afterRejected: 3).
    expect((await metric('gateway_rejections_total{reason="month"}')) - before).toBe(3);
    expect(answers.filter((a) => a.code === 'monthly_quota_exceeded').length).toBe(3);
    // The burst's answers come in any order: after the third month refusal, the rest are the ban's.
    const refusal = answers.find((a) => a.code === 'monthly_quota_exceeded')!;
    expect(refusal.code).toBe('monthly_quota_exceeded');
    const { start, end } = currentPeriod(BILLING_DAY);
    const wait = Number(refusal.headers.get('retry-after'));
    expect(Math.abs(wait - (end - Date.now()) / 1000)).toBeLessThan(30);
    // Three items, still a structured-fields list (RFC 9651); the month's w is the period's length.
    const policy = parseList(refusal.headers.get('ratelimit-policy')!);
    expect(policy.map(([name, params]) => [name, Object.fromEntries(params)])).toEqual([
      ['minute', { q: 100_000, w: 60 }],
      ['day', { q: 1_000_000, w: 86_400 }],
      ['month', { q: 30, w: (end - start) / 1000 }],
    ]);
    expect(parseList(refusal.headers.get('ratelimit')!).map(([name]) => name)).toEqual(['minute', 'day', 'month']);
  });

  it('starts counting afresh when Redis finds the stored period over', async () => {
    const [g] = gateways;
    const name = redisKeyOf(g!.gateway.config(), keys.rollover.id);
    const { start } = currentPeriod(BILLING_DAY);
    const previous = currentPeriod(BILLING_DAY, start - DAY).start;
    // The last period used up: its count is stored under its own start.
    await g!.redis!.hset(name, 'ps', previous, 'pc', 30);
    const res = await call(`${g!.url}/v1/pets`, keys.rollover.key);
    expect(res.status).toBe(200);
    expect(await g!.redis!.hmget(name, 'ps', 'pc')).toEqual([String(start), '1']);
  });
});

describe('overage', () => {
  it('admits exactly the quota and the overage across three instances, and marks exactly the overage', async () => {
    const { answers, key, before } = await exactBurst(keys.metered, 1700, () => metric('gateway_overage_requests_total{plan="metered"}'));
    expect({ admitted: count(answers, 200), refused: count(answers, 429) }).toEqual({ admitted: 1500, refused: 200 });
    const marked = answers.filter((a) => a.status === 200 && a.headers.get('x-quota-overage') !== null);
    expect(marked.length).toBe(500);
    expect((await metric('gateway_overage_requests_total{plan="metered"}')) - before).toBe(500);
    const usage = await (await admin(0, `/admin/accounts/${key.id}/usage`)).json();
    expect(usage.overage).toEqual({ window: 'month', quota: 1000, upTo: 500, used: 500 });
    expect(usage.limits.perMonth).toBe(1000);
    expect(usage.windows.month).toMatchObject({ limit: 1500, used: 1500, remaining: 0 });
  });
});

describe('prepaid credits', () => {
  it('admits exactly the balance across three instances, then 402 credits_exhausted until the next grant', async () => {
    const { answers, before } = await exactBurst(keys.prepaid, 60, () => metric('gateway_rejections_total{reason="credits"}'));
    expect({ admitted: count(answers, 200), out: count(answers, 402) }).toEqual({ admitted: 20, out: 40 });
    expect((await metric('gateway_rejections_total{reason="credits"}')) - before).toBe(40);
    const out = answers.find((a) => a.status === 402)!;
    expect(out.code).toBe('credits_exhausted');
    expect(out.headers.get('x-credits-remaining')).toBe('0');
    expect(out.headers.get('ratelimit-policy')).toContain('"day"');
    // A grant is due at the next period's start: Retry-After says when.
    const { end } = currentPeriod(BILLING_DAY);
    expect(Math.abs(Number(out.headers.get('retry-after')) - (end - Date.now()) / 1000)).toBeLessThan(30);
  });

  it('without a grant due, answers 402 without Retry-After; a top-up admits exactly what it added', async () => {
    const before = await burst(keys.topups, 3);
    expect(before.map((a) => [a.status, a.code, a.headers.get('retry-after')])).toEqual(Array(3).fill([402, 'credits_exhausted', null]));
    expect((await topUp(1, keys.topups.id, { amount: 25, reason: 'invoice 1' }, 'inv-1')).status).toBe(201);
    const after = await burst(keys.topups, 40);
    expect({ admitted: count(after, 200), out: count(after, 402) }).toEqual({ admitted: 25, out: 15 });
  });

  it('applies a top-up once, however many retries race on every instance', async () => {
    const id = keys.racing.id;
    const answers = await Promise.all(
      Array.from({ length: 30 }, (_, i) =>
        topUp(i % 3, id, { amount: 7, reason: 'order 42' }, 'order-42').then(async (r) => ({
          status: r.status,
          body: await r.json(),
          replayed: r.headers.get('idempotent-replayed'),
        })),
      ),
    );
    expect(answers.filter((a) => a.status === 201).length).toBe(1);
    expect(answers.filter((a) => a.status === 200 && a.replayed === 'true').length).toBe(29);
    expect(new Set(answers.map((a) => a.body.entryId)).size).toBe(1);
    expect(answers.every((a) => a.body.balance === 7)).toBe(true);
    const credits = await (await admin(2, `/admin/accounts/${id}/credits`)).json();
    expect(credits).toMatchObject({ balance: 7, granted: 0, purchased: 7 });
    expect(credits.ledger.filter((e: { kind: string }) => e.kind === 'topup')).toEqual([
      expect.objectContaining({ amount: 7, balance: 7, reason: 'order 42', idempotencyKey: 'order-42' }),
    ]);
    // The same key for another top-up is a mistake, not a retry.
    const reused = await topUp(0, id, { amount: 8, reason: 'order 42' }, 'order-42');
    expect([reused.status, (await reused.json()).code]).toEqual([422, 'idempotency_key_reused']);
  });

  it("grants the period's credits when Redis finds the last grant in an earlier period, and writes it to the ledger", async () => {
    const [g] = gateways;
    const name = redisKeyOf(g!.gateway.config(), keys.granted.id);
    const { start } = currentPeriod(BILLING_DAY);
    const previous = currentPeriod(BILLING_DAY, start - DAY).start;
    await g!.redis!.hset(`${name}:credits`, 'g', 4, 'p', 1, 'gp', previous);
    const res = await call(`${g!.url}/v1/pets`, keys.granted.key);
    expect(res.status).toBe(200);
    expect(res.headers.get('x-credits-remaining')).toBe('20');
    const credits = await (await admin(0, `/admin/accounts/${keys.granted.id}/credits`)).json();
    // No rollover: the 4 left of the last grant expired, the purchased one stays; one unit spent from the grant.
    expect(credits).toMatchObject({ balance: 20, granted: 19, purchased: 1 });
    expect(credits.ledger).toEqual([expect.objectContaining({ kind: 'grant', amount: 20, periods: 1, expired: 4, balance: 21 })]);
  });
});

describe('periods that did not follow on', () => {
  it('with rollover, grants once for each period an idle account missed, in one ledger entry', async () => {
    const [g] = gateways;
    const name = redisKeyOf(g!.gateway.config(), keys.idle.id);
    const { start } = currentPeriod(BILLING_DAY);
    const before = (n: number) => {
      let p = start;
      for (let i = 0; i < n; i++) p = currentPeriod(BILLING_DAY, p - DAY).start;
      return p;
    };
    // The last grant was three periods ago (it ended two periods ago): the two since and this one are due.
    await g!.redis!.hset(`${name}:credits`, 'g', 1, 'p', 0, 'gp', before(3), 'ge', before(2));
    const res = await call(`${g!.url}/v1/pets`, keys.idle.key);
    expect(res.headers.get('x-credits-remaining')).toBe(String(1 + 3 * 5 - 1));
    const credits = await (await admin(0, `/admin/accounts/${keys.idle.id}/credits`)).json();
    expect(credits.ledger).toEqual([expect.objectContaining({ kind: 'grant', amount: 15, periods: 3, expired: 0, balance: 16 })]);
  });

  it('a billing day moved in mid-period keeps the period in force: its count and its grant stand', async () => {
    const [g] = gateways;
    const name = redisKeyOf(g!.gateway.config(), keys.moved.id);
    // A period in force that the billing day no longer gives: from 5 days ago to 5 days ahead.
    const [from, to] = [Date.now() - 5 * DAY, Date.now() + 5 * DAY];
    await g!.redis!.hset(name, 'ps', from, 'pe', to, 'pc', 40);
    await g!.redis!.hset(`${name}:credits`, 'g', 2, 'p', 0, 'gp', from, 'ge', to);
    const res = await call(`${g!.url}/v1/pets`, keys.moved.key);
    expect(res.status).toBe(200);
    expect(res.headers.get('x-credits-remaining')).toBe('1'); // no new grant
    expect(await g!.redis!.hmget(name, 'ps', 'pc', 'pe')).toEqual([String(from), '41', String(to)]);
    const usage = await (await call(`${g!.url}/v1/me/usage`, keys.moved.key)).json();
    expect(usage.period).toMatchObject({ start: new Date(from).toISOString(), end: new Date(to).toISOString() });
    expect(usage.windows.month).toMatchObject({ used: 41, resetAt: new Date(to).toISOString() });
    expect((await (await admin(0, `/admin/accounts/${keys.moved.id}/credits`)).json()).ledger).toEqual([]);
  });
});

describe('billing.lua', () => {
  it('computes the same periods in Redis as period.ts does with JavaScript dates, for every day of eight years', async () => {
    const redis = testClient(inject('redisUrl'));
    try {
      const lua = readFileSync(new URL('../../gateway/quota/redis/billing.lua', import.meta.url), 'utf8');
      const from = Date.UTC(2024, 0, 1);
      const days = 8 * 366;
      const script = `${lua}
        local out = {}
        for i = 0, ${days - 1} do
          for _, bd in ipairs({1, 15, 28, 29, 30, 31}) do
            for _, off in ipairs({0, 43200000, 86399999}) do
              local s, e = period(${from} + i * DAY + off, bd)
              out[#out + 1] = s
              out[#out + 1] = e
            end
          end
        end
        return out`;
      const got = (await redis.eval(script, 0)) as number[];
      const want: number[] = [];
      for (let i = 0; i < days; i++) {
        for (const bd of [1, 15, 28, 29, 30, 31]) {
          for (const off of [0, 43_200_000, 86_399_999]) {
            const p = billingPeriod(from + i * DAY + off, bd);
            want.push(p.startMs, p.endMs);
          }
        }
      }
      expect(got.length).toBe(want.length);
      expect(got).toEqual(want);
    } finally {
      redis.disconnect();
    }
  });
});

describe('no charge for the gateway own failures', () => {
  it.each([
    ['Redis', undefined],
    ['the in-process store', false as const],
  ])('a 502 gives its credits and its overage back, and is not billed as overage (%s)', async (_, redis) => {
    const prepaid = makeKey('small');
    const closed = await freePort();
    const config = testConfig([prepaid], {
      // A request costs 3 on a quota of 1 a month (and 10 more): 2 of its units are overage.
      plans: {
        small: {
          ...{ perMinute: 1000, perDay: 100_000, perMonth: 1, overage: { upTo: 10 } },
          ...{ credits: { grant: 3, every: 'month' as const }, costs: { 'GET /v1/pets': 3 } },
        },
      },
      accounts: { [prepaid.id]: { billingDay: BILLING_DAY } },
    });
    const gw = await buildTestGateway({ config, backend: `http://127.0.0.1:${closed}`, redis, admin: { token: ADMIN_TOKEN } });
    const balance = async () =>
      (
        await (
          await fetch(`${gw.adminUrl}/admin/accounts/${prepaid.id}/credits`, { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } })
        ).json()
      ).balance;
    const statuses = [];
    for (let i = 0; i < 5; i++) {
      const res = await gw.call('/v1/pets', prepaid.key);
      await res.arrayBuffer();
      statuses.push(res.status);
      // The refund is sent after the answer: the next request waits for it, or would find 2 left.
      await eventually(async () => (await balance()) === 3, 5000, 'the credit given back');
    }
    // Five 502s of 3 units on a balance of 3: none of them was charged.
    expect(statuses).toEqual([502, 502, 502, 502, 502]);
    const usage = await (
      await fetch(`${gw.adminUrl}/admin/accounts/${prepaid.id}/usage`, { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } })
    ).json();
    expect([usage.windows.month.used, usage.overage.used]).toEqual([0, 0]);
    const metrics = await (await fetch(`${gw.adminUrl}/metrics`)).text();
    expect(metrics).not.toMatch(/^gateway_overage_requests_total\{plan="small"\} [1-9]/m);
    expect(gw.logs.filter((l) => l.msg === 'request' && l.overage !== undefined)).toEqual([]);
  });
});

describe("the consumer's own view", () => {
  it('GET /v1/me/usage shows the period, the balance and the overage, as the admin lookup does', async () => {
    const answers = await burst(keys.viewer, 7); // a quota of 5 and 2 of overage: all admitted, the last two past the quota
    expect(count(answers, 200)).toBe(7);
    const { start, end } = currentPeriod(BILLING_DAY);
    const own = await (await call(`${gateways[0]!.url}/v1/me/usage`, keys.viewer.key)).json();
    expect(own).toMatchObject({
      limits: { perMinute: 100_000, perDay: 1_000_000, perMonth: 5 },
      windows: { month: { limit: 7, used: 7, remaining: 0, resetAt: new Date(end).toISOString() } },
      period: { start: new Date(start).toISOString(), end: new Date(end).toISOString(), billingDay: BILLING_DAY },
      overage: { window: 'month', quota: 5, upTo: 2, used: 2 },
      credits: { balance: 3, granted: 3, purchased: 0, grant: 10, rollover: true, nextGrantAt: new Date(end).toISOString() },
    });
    // The admin lookup shows the same view, with the store it read and the account's keys beside it.
    const viaAdmin = await (await admin(1, `/admin/accounts/${keys.viewer.id}/usage`)).json();
    expect({ ...viaAdmin, store: undefined, keys: undefined, at: undefined }).toEqual({ ...own, at: undefined });
  });
});
