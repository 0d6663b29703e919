import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { describe, expect, inject, it } from 'vitest';
import { loadSettings } from '../../gateway/config/settings.js';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { policyHeader } from '../../gateway/quota/headers.js';
import { RedisQuotaStore } from '../../gateway/quota/redis/store.js';
import { makeKey, redisKeyOf, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway, useTestGateway } from '../helpers/gateway.js';
import { startSink } from '../helpers/sink.js';
import { eventually, inOneMinute, secondsTo } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

// The hour window as clients meet it, through the in-process gateway: on real Redis (quota.lua)
// and on the in-process store. A run within one UTC minute is within one UTC hour.

const hourly = makeKey('hourly'); // the plan's: 3 an hour
const own = { ...makeKey('enterprise'), limits: { perMinute: 10, perHour: 2, perDay: 100 } }; // the key's own: 2 an hour
const config = testConfig([hourly, own], {
  plans: { hourly: { perMinute: 10, perHour: 3, perDay: 100 }, enterprise: { custom: true } },
});

const silent = { warn: () => {}, info: () => {}, error: () => {} } as unknown as FastifyBaseLogger;

async function refusedPastTheHour(gw: TestGateway, key: string, perHour: number) {
  const first = await gw.call('/v1/pets', key);
  expect(first.status).toBe(200);
  expect(first.headers.get('ratelimit-policy')).toBe(`"minute";q=10;w=60, "hour";q=${perHour};w=3600, "day";q=100;w=86400`);
  expect(first.headers.get('ratelimit')).toMatch(new RegExp(`^"minute";r=9;t=\\d+, "hour";r=${perHour - 1};t=\\d+, "day";r=99;t=\\d+$`));
  for (let i = 1; i < perHour; i++) expect((await gw.call('/v1/pets', key)).status).toBe(200);
  const sentAt = Date.now();
  const res = await gw.call('/v1/pets', key);
  const answeredAt = Date.now();
  expect(res.status).toBe(429);
  expect(await res.json()).toEqual({
    code: 'hourly_quota_exceeded',
    message: expect.stringMatching(new RegExp(`^Hourly limit of ${perHour} requests reached; retry after \\d+ s$`)),
    status: 429,
  });
  const retry = Number(res.headers.get('retry-after'));
  const { min, max } = secondsTo(Math.ceil(answeredAt / 3_600_000) * 3_600_000, sentAt, answeredAt);
  expect(retry >= min && retry <= max, `retry-after ${retry} in [${min}, ${max}]`).toBe(true);
  expect(res.headers.get('x-ratelimit-limit')).toBe(String(perHour));
  expect(res.headers.get('x-ratelimit-remaining')).toBe('0');
  expect(Number(res.headers.get('x-ratelimit-reset'))).toBe(Math.ceil(Date.now() / 3_600_000) * 3600);
  expect(res.headers.get('ratelimit')).toMatch(
    new RegExp(`^"minute";r=${10 - perHour};t=\\d+, "hour";r=0;t=\\d+, "day";r=${100 - perHour};t=\\d+$`),
  );
  expect(res.headers.get('cache-control')).toBe('no-store');
}

describe('the hour window through the gateway, on Redis', () => {
  const gw = useTestGateway({ config, backend: 'pets', admin: { token: 'admin-token-0123456789' } }); // the pets backend: the public document merges its paths

  it("refuses a plan's key past perHour with 429 hourly_quota_exceeded, counted in the account's hash", async () => {
    await inOneMinute(async () => {
      await refusedPastTheHour(gw, hourly.key, 3);
      const name = redisKeyOf(gw.gateway.config(), hourly.id);
      const [hs, hc] = await gw.redis!.hmget(name, 'hs', 'hc');
      expect([Number(hs) % 3_600_000, hc]).toEqual([0, '3']); // a UTC hour's start; the refusal not counted
    }, gw.freshCounters);
  });

  it('refuses a key past its own perHour', async () => {
    await inOneMinute(() => refusedPastTheHour(gw, own.key, 2), gw.freshCounters);
  });

  it('documents perHour and the hour in both OpenAPI documents', async () => {
    const pub = (await (await gw.call('/v1/openapi.json')).json()) as {
      components: { schemas: { Usage: { properties: { limits: { properties: object }; windows: { properties: object } } } } };
    };
    const usage = pub.components.schemas.Usage.properties;
    expect(Object.keys(usage.limits.properties)).toEqual(['perMinute', 'perHour', 'perDay', 'perMonth']);
    expect(Object.keys(usage.windows.properties)).toEqual(['minute', 'hour', 'day', 'month']);
    expect(JSON.stringify(pub)).toContain('hourly_quota_exceeded');
    const admin = await (await fetch(`${gw.adminUrl}/openapi.json`)).text();
    expect(admin).toMatch(/"perHour":\{[^}]*"description":"Requests an hour \(UTC hours\)"/);
  });
});

describe('the hour window in usage events', () => {
  it("counts each request in the event's windows by name, the hour with them; null for a window the plan has not", async () => {
    const sink = await startSink();
    const plain = makeKey('plain');
    const roomy = makeKey('roomy'); // large limits: leased, its events written in the instance's batches
    const gw = await buildTestGateway({
      config: testConfig([hourly, plain, roomy], {
        plans: {
          hourly: { perMinute: 10, perHour: 3, perDay: 100 },
          plain: { perMinute: 10, perDay: 100 },
          roomy: { perMinute: 100_000, perHour: 1_000_000, perDay: 10_000_000 },
        },
        usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } },
      }),
    });
    try {
      let attempt = 0;
      await inOneMinute(async () => {
        // Request ids of this attempt's own: a minute that turned leaves the last attempt's events at the sink.
        const run = `run${++attempt}`;
        for (const [i, key] of [hourly, hourly, plain, roomy].entries()) {
          const res = await gw.call('/v1/pets', key.key, { headers: { 'x-request-id': `${run}-${i}` } });
          expect(res.status).toBe(200);
        }
        const mine = () => sink.requests().filter((e) => String(e.data!.requestId).startsWith(`${run}-`));
        await eventually(() => mine().length === 4, 20_000, 'the four events at the sink');
        const windows = (id: string) =>
          mine()
            .filter((e) => e.data!.keyId === id)
            .sort((a, b) => String(a.data!.requestId).localeCompare(String(b.data!.requestId)))
            .map((e) => e.data!.windows);
        expect(windows(hourly.id)).toEqual([
          { minute: 1, hour: 1, day: 1, month: null },
          { minute: 2, hour: 2, day: 2, month: null },
        ]);
        expect(windows(plain.id)).toEqual([{ minute: 1, hour: null, day: 1, month: null }]);
        // A leased unit's event shows its lease's counts, the hour with them: fresh windows, all alike.
        const [leased] = windows(roomy.id) as Array<{ minute: number; hour: number; day: number; month: null }>;
        expect(leased).toEqual({ minute: leased!.minute, hour: leased!.minute, day: leased!.minute, month: null });
        expect(leased!.minute).toBeGreaterThan(0);
      }, gw.freshCounters);
    } finally {
      await gw.close();
      await sink.close();
    }
  });
});

describe('the hour window through the gateway, in-process store', () => {
  const gw = useTestGateway({ config, redis: false });

  it('refuses past perHour with the same 429 and headers', async () => {
    await inOneMinute(async () => {
      await refusedPastTheHour(gw, hourly.key, 3);
      await refusedPastTheHour(gw, own.key, 2);
    }, gw.freshCounters);
  });
});

describe('the hour window and leases (Redis store, at the shipped QUOTA_LEASE_MAX)', () => {
  it('admits exactly the hour across two instances taking leases: no lease reaches past the hour', async () => {
    // A minute far above the hour, so only the hour bounds the leases (leaseSize: 1% of 251, 2 units).
    const limits = { perMinute: 10_000, perHour: 251, perDay: 1_000_000 }; // odd: leases of 2 would step over it
    const redis = testClient(inject('redisUrl'));
    const stores = [0, 1].map(() => new RedisQuotaStore(redis, silent, { leaseMax: loadSettings({}).quotaLeaseMax }));
    try {
      await inOneMinute(async () => {
        const s: QuotaSubject = {
          name: `gw:test:{k:${randomUUID()}}`,
          limits,
          bans: null,
          policy: policyHeader(limits),
          lasting: true,
          enforce: true,
          billing: NO_BILLING,
          events: 0,
          alerts: '',
        };
        let admitted = 0;
        for (let i = 0; i < 300; i++) if ((await stores[i % 2]!.consume(s)).outcome === 'allowed') admitted++;
        expect(admitted).toBe(251);
        expect(await redis.hget(s.name, 'hc')).toBe('251');
      });
    } finally {
      await Promise.all(stores.map((st) => st.close()));
      await redis.quit();
    }
  });
});
