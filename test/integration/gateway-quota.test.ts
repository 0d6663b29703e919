import { describe, expect, it } from 'vitest';
import { call, makeKey, testConfig } from '../helpers/config.js';
import { buildInstances, buildTestGateway, type TestGateway, useTestGateway } from '../helpers/gateway.js';
import { eventually, inOneMinute, secondsTo } from '../helpers/time.js';

// Quotas as clients meet them, through the in-process gateway on real Redis. Each test
// counts on keys no other test touches, and runs within one UTC minute (inOneMinute).
const free = makeKey('free'); // 5/min
const tiny = makeKey('tiny'); // 3/min, 4/day
const daily = { ...makeKey('enterprise'), limits: { perMinute: 10, perDay: 3 } };
const crowd = { ...makeKey('enterprise'), limits: { perMinute: 40, perDay: 100000 } };
const offender = makeKey('free');
const config = testConfig([free, tiny, daily, crowd, offender]);
const gw = useTestGateway({ config });

const statuses = async (g: TestGateway, key: string | undefined, n: number) => {
  const out: number[] = [];
  for (let i = 0; i < n; i++) out.push((await g.call('/v1/pets', key)).status);
  return out;
};

describe('quotas through the gateway', () => {
  it('refuses past the minute limit with 429, rate_limited and Retry-After to the minute end', async () => {
    await inOneMinute(async () => {
      expect(await statuses(gw, free.key, 5)).toEqual([200, 200, 200, 200, 200]);
      const sentAt = Date.now();
      const res = await gw.call('/v1/pets', free.key);
      const answeredAt = Date.now();
      expect(res.status).toBe(429);
      expect(await res.json()).toEqual({ code: 'rate_limited', message: expect.stringContaining('Minute limit of 5'), status: 429 });
      const retry = Number(res.headers.get('retry-after'));
      const { min, max } = secondsTo(Math.ceil(answeredAt / 60_000) * 60_000, sentAt, answeredAt);
      expect(retry >= min && retry <= max, `retry-after ${retry} in [${min}, ${max}]`).toBe(true);
      expect(res.headers.get('x-ratelimit-remaining')).toBe('0');
      expect(Number(res.headers.get('x-ratelimit-reset'))).toBe(Math.ceil(Date.now() / 60_000) * 60);
      expect(res.headers.get('cache-control')).toBe('no-store');
    }, gw.freshCounters);
  });

  it('does not charge the day window for requests refused by the minute limit', async () => {
    await inOneMinute(async () => {
      expect(await statuses(gw, tiny.key, 5)).toEqual([200, 200, 200, 429, 429]);
      // The third refusal (one short of a ban): 3 admitted of 4 a day, so one is left.
      const res = await gw.call('/v1/pets', tiny.key);
      expect(res.status).toBe(429);
      expect(res.headers.get('ratelimit')).toMatch(/^"minute";r=0;t=\d+, "day";r=1;t=\d+$/);
    }, gw.freshCounters);
  });

  it('refuses past the day limit with daily_quota_exceeded and Retry-After to 00:00 UTC', async () => {
    await inOneMinute(async () => {
      expect(await statuses(gw, daily.key, 3)).toEqual([200, 200, 200]);
      const sentAt = Date.now();
      const res = await gw.call('/v1/pets', daily.key);
      const answeredAt = Date.now();
      expect(res.status).toBe(429);
      expect((await res.json()).code).toBe('daily_quota_exceeded');
      const retry = Number(res.headers.get('retry-after'));
      const { min, max } = secondsTo(Math.ceil(answeredAt / 86_400_000) * 86_400_000, sentAt, answeredAt);
      expect(retry >= min && retry <= max, `retry-after ${retry} in [${min}, ${max}]`).toBe(true);
      expect(res.headers.get('x-ratelimit-limit')).toBe('3');
    }, gw.freshCounters);
  });

  it('bans a key that keeps sending after 429s, on every instance, without extending the ban', async () => {
    const b = await buildTestGateway({ config, backend: gw.backendUrl });
    const c = await buildTestGateway({ config, backend: gw.backendUrl });
    const all = [gw, b, c];
    // One Redis prefix for all three instances, fresh for each run.
    const share = () => {
      gw.freshCounters();
      for (const other of [b, c]) other.gateway.setConfig(gw.gateway.config());
    };
    share();
    await inOneMinute(
      async () => {
        // 5 admitted, 3 refusals allowed, the 4th refusal within 60 s bans.
        expect(await statuses(gw, offender.key, 9)).toEqual([200, 200, 200, 200, 200, 429, 429, 429, 429]);
        const first = await b.call('/v1/pets', offender.key);
        expect(first.status).toBe(429);
        expect((await first.json()).code).toBe('key_banned');
        const retry = Number(first.headers.get('retry-after'));
        expect(retry).toBeGreaterThan(890);
        expect(retry).toBeLessThanOrEqual(900);
        expect(first.headers.get('x-ratelimit-remaining')).toBe('0');
        const reset = Number(first.headers.get('x-ratelimit-reset'));
        expect(Math.abs(reset - (Date.now() / 1000 + retry))).toBeLessThanOrEqual(2);
        for (const g of [...all, gw]) {
          const res = await g.call('/v1/pets', offender.key);
          expect(res.status).toBe(429);
          expect(res.headers.get('x-ratelimit-reset')).toBe(String(reset)); // not extended
        }
      },
      share,
      all,
    );
  });

  it('limits requests without a valid key per address', async () => {
    gw.freshCounters(); // requests without a key all come from 127.0.0.1: start this address at zero
    await inOneMinute(async () => {
      // unauthenticated allows 4 a minute
      expect(await statuses(gw, undefined, 6)).toEqual([401, 401, 401, 401, 429, 429]);
    }, gw.freshCounters);
  });
});

describe('several gateway instances on one Redis', () => {
  it('admit exactly the limit under concurrent load', async () => {
    const { instances, share } = await buildInstances(3, { config, backend: gw.backendUrl });
    await inOneMinute(
      async () => {
        const all = await Promise.all(
          Array.from({ length: 120 }, (_, i) => call(`${instances[i % 3]!.url}/v1/pets`, crowd.key).then((r) => r.status)),
        );
        expect(all.filter((s) => s === 200)).toHaveLength(40);
        expect(all.filter((s) => s === 429)).toHaveLength(80);
        const after = await instances[1]!.call('/v1/pets', crowd.key);
        expect(after.headers.get('x-ratelimit-limit')).toBe('40');
        expect(after.headers.get('x-ratelimit-remaining')).toBe('0');
      },
      share,
      instances,
    );
  });
});

describe('shadow mode (enforce: false) across instances', () => {
  it('admits every request, counts exactly what an enforced plan would, and reports each refusal it did not make', async () => {
    const trial = { ...makeKey('trial'), limits: { perMinute: 30, perDay: 100000 } };
    const shadowConfig = testConfig([trial], {
      plans: { free: { perMinute: 5, perDay: 1000 }, trial: { perMinute: 5, perDay: 1000, enforce: false } },
    });
    const { instances, share } = await buildInstances(3, { config: shadowConfig, backend: gw.backendUrl, admin: {} });
    // Refusals not made, by reason, summed over the instances: from the metric and from the access lines.
    const fromMetrics = async () => {
      const scraped = await Promise.all(instances.map((g) => fetch(`${g.adminUrl}/metrics`).then((r) => r.text())));
      const sum = (reason: string) =>
        scraped
          .map((t) => Number(new RegExp(`^gateway_would_reject_total\\{reason="${reason}",plan="trial"\\} (\\d+)$`, 'm').exec(t)?.[1] ?? 0))
          .reduce((a, b) => a + b);
      return [sum('minute'), sum('banned')];
    };
    const fromLines = () =>
      ['would_minute', 'would_banned'].map((o) => instances.flatMap((g) => g.logs).filter((l) => l.outcome === o).length);
    await inOneMinute(
      async () => {
        // An attempt redone after a minute boundary starts from what the discarded one left.
        const [metricsBefore, linesBefore] = [await fromMetrics(), fromLines()];
        const all = await Promise.all(
          Array.from({ length: 90 }, (_, i) => call(`${instances[i % 3]!.url}/v1/pets`, trial.key).then((r) => r.status)),
        );
        expect(all).toEqual(Array(90).fill(200));
        // Counted as the enforced plan counts: exactly its 30, at the shipped leases and Redis timeout.
        const usage = await instances[2]!.call('/v1/pets', trial.key);
        expect(usage.headers.get('ratelimit')).toMatch(/^"minute";r=0;/);
        expect(usage.headers.get('retry-after')).toBeNull();
        // The refusals an enforced plan would have made: 3 over the minute, then the ban
        // (afterRejected 3) for the other 58 (57 of the burst and the last call).
        const since = (now: number[], before: number[]) => now.map((n, i) => n - before[i]!);
        expect(since(await fromMetrics(), metricsBefore)).toEqual([3, 58]);
        await eventually(() => since(fromLines(), linesBefore).join() === '3,58', 2000, 'the access lines of the refusals not made');
      },
      share,
      instances,
    );
  });
});
