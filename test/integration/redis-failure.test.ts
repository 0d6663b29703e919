import { describe, expect, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { makeKey, redisKeyOf, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { spawnRedis, testClient } from '../helpers/redis.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// Three gateway instances on one Redis of their own, which the tests freeze (SIGSTOP) or kill
// (SIGKILL) mid-traffic, at the shipped settings. While Redis fails, each instance admits only
// its share of what it last knew was left (the degraded budget), keeps serving (no 5xx), and
// writes what it admitted back to Redis, once, when Redis answers again.

const instancesSeen = async (g: TestGateway) => Number(/^gateway_quota_instances (\d+)$/m.exec(await g.gateway.metrics.text())?.[1]);

async function fleet(config: ConfigFile) {
  const redis = await spawnRedis();
  onTestFinished(() => redis.stop());
  const first = await buildTestGateway({ config, redis: redis.url });
  const others = await Promise.all([0, 1].map(() => buildTestGateway({ config, redis: redis.url, backend: first.backendUrl })));
  const all = [first, ...others];
  /** One Redis prefix for all three, fresh; back on Redis, and each instance counting all three. */
  const share = async () => {
    await eventually(() => all.every((g) => !g.gateway.store.degraded), 5000, 'back on Redis');
    first.freshCounters();
    for (const g of others) g.gateway.setConfig(first.gateway.config());
    await eventually(async () => (await Promise.all(all.map(instancesSeen))).every((n) => n === 3), 5000, 'three instances registered');
  };
  await share();
  const counted = async (id: string, field: 'mc' | 'dc') => {
    const check = testClient(redis.url);
    try {
      return Number(await check.hget(redisKeyOf(first.gateway.config(), id), field));
    } finally {
      check.disconnect();
    }
  };
  return { redis, all, share, counted, echo: first.echo! };
}

const tenAMinute = () => ({ ...makeKey('enterprise'), limits: { perMinute: 10, perDay: 100_000 } });

describe('Redis failing under three instances', () => {
  it('frozen: together they admit at most what each last knew was left, and write it back once', { timeout: scaled(30_000) }, async () => {
    const keys = [tenAMinute(), tenAMinute(), tenAMinute()];
    const { redis, all, share, counted } = await fleet(testConfig(keys));
    let run = 0;
    await inOneMinute(
      async () => {
        const k = keys[run]!;
        // Four decided in Redis, one after another on A, B, C, A: A last saw 4, B 2, C 3.
        for (let i = 0; i < 4; i++) expect((await all[i % 3]!.call('/v1/pets', k.key)).status).toBe(200);
        const statuses: number[] = [];
        redis.proc.kill('SIGSTOP');
        try {
          for (let i = 0; i < 30; i++) statuses.push((await all[i % 3]!.call('/v1/pets', k.key)).status);
        } finally {
          redis.proc.kill('SIGCONT');
        }
        expect(statuses.filter((s) => s !== 200 && s !== 429)).toEqual([]);
        const admitted = statuses.filter((s) => s === 200).length;
        // Shares of 6, 8 and 7 left among three (2 each, and one more by rank where it divides
        // unevenly): 6 to 8, so 10 to 12 in all: the limit, plus the 2 counts B had not seen.
        expect(admitted).toBeGreaterThanOrEqual(6);
        expect(admitted).toBeLessThanOrEqual(8);
        await eventually(() => all.every((g) => !g.gateway.store.degraded), 5000, 'back on Redis');
        expect(await counted(k.id, 'mc')).toBe(4 + admitted);
      },
      async () => {
        run++;
        await share();
      },
    );
  });

  for (const fault of ['frozen', 'killed'] as const) {
    it(`${fault} mid-burst: no 5xx, and at most twice the limit in that minute`, { timeout: scaled(30_000) }, async () => {
      const keys = [tenAMinute(), tenAMinute(), tenAMinute()];
      const { redis, all, share, counted, echo } = await fleet(testConfig(keys));
      let run = 0;
      await inOneMinute(
        async () => {
          const k = keys[run]!;
          const before = echo.seen.length;
          const burst = Promise.all(Array.from({ length: 60 }, (_, i) => all[i % 3]!.call('/v1/pets', k.key).then((r) => r.status)));
          // The fault strikes once the first admissions reach the backend: mid-burst.
          await eventually(() => echo.seen.length >= before + 3, 5000, 'the burst under way');
          redis.proc.kill(fault === 'frozen' ? 'SIGSTOP' : 'SIGKILL');
          let statuses: number[];
          try {
            statuses = await burst;
          } finally {
            if (fault === 'frozen') redis.proc.kill('SIGCONT');
          }
          expect(statuses.filter((s) => s !== 200 && s !== 429)).toEqual([]);
          const admitted = statuses.filter((s) => s === 200).length;
          expect(admitted).toBeGreaterThanOrEqual(3);
          expect(admitted).toBeLessThanOrEqual(20);
          if (fault === 'frozen') {
            // Every admission is in Redis once it answers: decided there, or written back.
            await eventually(() => all.every((g) => !g.gateway.store.degraded), 5000, 'back on Redis');
            expect(await counted(k.id, 'mc')).toBe(admitted);
          }
        },
        async () => {
          run++;
          await share();
        },
      );
    });
  }
});
