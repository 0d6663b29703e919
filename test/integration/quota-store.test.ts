import { randomUUID } from 'node:crypto';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { Redis } from 'ioredis';
import calculateSlot from 'cluster-key-slot';
import { afterAll, beforeAll, describe, expect, inject, it, vi } from 'vitest';
import type { FastifyBaseLogger } from 'fastify';
import { compileConfig, validateConfigFile } from '../../gateway/config/config.js';
import { DAY_MS, type Decision, MINUTE_MS, NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { MemoryQuotaStore } from '../../gateway/quota/memory-store.js';
import { RedisQuotaStore } from '../../gateway/quota/redis/store.js';
import { type QuotaStore, QuotaStoreUnavailable } from '../../gateway/quota/store.js';
import { quotaArg, writeBackArgs } from '../../gateway/quota/redis/script.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

const silent = { warn: () => {}, info: () => {}, error: () => {} } as unknown as FastifyBaseLogger;
const bans = { afterRejected: 3, withinMs: 60_000, durationMs: 900_000 };
const subject = (perMinute: number, perDay: number, withBans = true): QuotaSubject => ({
  name: `gw:test:{k:${randomUUID()}}`,
  limits: { perMinute, perDay },
  bans: withBans ? bans : null,
  policy: '',
  lasting: true,
  billing: NO_BILLING,
  events: 0,
  alerts: '',
  enforce: true,
});

async function outcomes(store: QuotaStore, s: QuotaSubject, n: number): Promise<string[]> {
  const out: string[] = [];
  for (let i = 0; i < n; i++) {
    out.push((await store.consume(s)).outcome);
  }
  return out;
}

let redis: Redis;
beforeAll(async () => {
  redis = testClient(inject('redisUrl'), { enableOfflineQueue: true });
});
afterAll(() => redis.quit());

// The same rules, run against both stores: Redis (quota.lua) and the in-process twin.
describe.each([
  ['redis', () => new RedisQuotaStore(redis, silent) as QuotaStore],
  ['memory', () => new MemoryQuotaStore() as QuotaStore],
])('%s store', (_, make) => {
  it('admits while both windows have room and counts once in each', async () => {
    await inOneMinute(async () => {
      const store = make();
      const s = subject(3, 100, false);
      const first = await store.consume(s);
      expect(first.windows.map((w) => [w.name, w.used])).toEqual([
        ['minute', 1],
        ['day', 1],
      ]);
      expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'minute']);
    });
  });

  it('a request with a cost is admitted only when every window has room for all of it, and counts all of it', async () => {
    await inOneMinute(async () => {
      const store = make();
      const s = subject(12, 100, false);
      expect((await store.consume(s, 5)).windows.map((w) => w.used)).toEqual([5, 5]);
      expect((await store.consume(s, 5)).outcome).toBe('allowed'); // 10
      expect((await store.consume(s, 5)).outcome).toBe('minute'); // 15 > 12: refused, counted nowhere
      expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'minute']); // 11, 12, then full
      const last = await store.consume(s, 1);
      expect(last.windows.find((w) => w.name === 'minute')!.used).toBe(12);
      await store.refund(s, last.nowMs, 5);
      expect((await store.peek(s)).minuteUsed).toBe(7);
    });
  });

  it('a refund gives one unit back to the windows that counted it, never to later ones, never below 0', async () => {
    await inOneMinute(async () => {
      const store = make();
      const s = subject(2, 100, false);
      const first = await store.consume(s);
      await store.consume(s);
      expect((await store.consume(s)).outcome).toBe('minute');
      await store.refund(s, first.nowMs);
      const after = await store.peek(s);
      expect([after.minuteUsed, after.dayUsed]).toEqual([1, 1]);
      // Counted in an earlier minute (and day): that window is over, nothing to give back.
      await store.refund(s, first.nowMs - DAY_MS);
      expect((await store.peek(s)).minuteUsed).toBe(1);
      await store.refund(s, first.nowMs);
      await store.refund(s, first.nowMs);
      const floor = await store.peek(s);
      expect([floor.minuteUsed, floor.dayUsed]).toEqual([0, 0]);
    });
  });

  it('does not count a refused request in either window', async () => {
    await inOneMinute(async () => {
      const store = make();
      const s = subject(2, 100, false);
      await outcomes(store, s, 10); // 2 admitted, 8 refused by the minute
      const probe = { ...s, limits: { perMinute: 100, perDay: 100 } };
      const d = await store.consume(probe);
      expect(d.windows.map((w) => w.used)).toEqual([3, 3]);
    });
  });

  it('refuses on the day window, which wins when both are full', async () => {
    await inOneMinute(async () => {
      const store = make();
      const s = subject(2, 2, false);
      expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'day']);
    });
  });

  it('bans after more than afterRejected refusals, and requests during the ban do not extend it', async () => {
    await inOneMinute(async () => {
      const store = make();
      const s = subject(1, 100);
      expect(await outcomes(store, s, 6)).toEqual(['allowed', 'minute', 'minute', 'minute', 'banned', 'banned']);
      const a = await store.consume(s);
      const b = await store.consume(s);
      if (a.outcome !== 'banned' || b.outcome !== 'banned') throw new Error('expected a ban');
      expect(b.banUntilMs).toBe(a.banUntilMs);
      expect(a.banUntilMs - a.nowMs).toBeLessThanOrEqual(bans.durationMs);
      expect(a.banUntilMs - a.nowMs).toBeGreaterThan(bans.durationMs - 5000);
    });
  });

  it('has no day window for a subject without one', async () => {
    const store = make();
    const d = await store.consume(subject(5, 0, false));
    expect(d.windows.map((w) => w.name)).toEqual(['minute']);
  });
});

describe('memory store with an injected clock', () => {
  it('rolls the minute at :00 UTC and the day at 00:00 UTC', async () => {
    let now = Date.UTC(2026, 10, 22, 23, 59, 30);
    const store = new MemoryQuotaStore(() => now);
    const s = subject(2, 3, false);
    expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'minute']);
    now = Date.UTC(2026, 10, 22, 23, 59, 59, 999);
    expect(await outcomes(store, s, 1)).toEqual(['minute']);
    now += 1; // 00:00:00.000: a new minute and a new day
    expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'minute']);
    now += MINUTE_MS;
    expect(await outcomes(store, s, 2)).toEqual(['allowed', 'day']);
    now += DAY_MS;
    expect(await outcomes(store, s, 1)).toEqual(['allowed']);
  });

  it('counts refusals for a ban only within the window, and lifts the ban at its end', async () => {
    let now = Date.UTC(2026, 10, 22, 10, 0, 0);
    const store = new MemoryQuotaStore(() => now);
    const s = subject(1, 1000);
    expect(await outcomes(store, s, 3)).toEqual(['allowed', 'minute', 'minute']);
    now += 61_000; // the two refusals leave the 60 s ban window
    expect(await outcomes(store, s, 5)).toEqual(['allowed', 'minute', 'minute', 'minute', 'banned']);
    now += bans.durationMs - 1;
    expect(await outcomes(store, s, 1)).toEqual(['banned']);
    now += 1;
    expect(await outcomes(store, s, 1)).toEqual(['allowed']);
  });
});

describe('memory store upkeep', () => {
  it('forgets an address after its minute, as Redis expires it, and a key only after its day', async () => {
    let now = Date.UTC(2026, 10, 22, 10, 0, 0);
    const store = new MemoryQuotaStore(() => now);
    const address = subject(5, 0, false); // an address: minute window only
    const key = subject(5, 100, false); // a key: minute and day
    await store.consume(address);
    await store.consume(key);
    now += 61_000;
    await store.consume(subject(5, 100, false)); // any request: the sweep runs
    expect(await store.peek(address)).toMatchObject({ minuteUsed: 0, dayUsed: 0 });
    expect(await store.peek(key)).toMatchObject({ minuteUsed: 0, dayUsed: 1 }); // kept until midnight
    now = Date.UTC(2026, 10, 23, 0, 1, 0);
    await store.consume(subject(5, 0, false));
    expect(await store.peek(key)).toMatchObject({ minuteUsed: 0, dayUsed: 0 });
  });

  it('lifts a ban and forgets the recent 429s when asked', async () => {
    const store = new MemoryQuotaStore(() => Date.UTC(2026, 10, 22, 10, 0, 0));
    const s = subject(1, 0, true); // 1 a minute; banned after the 429s its ban policy allows
    let outcome = '';
    for (let i = 0; i < 10 && outcome !== 'banned'; i++) outcome = (await store.consume(s)).outcome;
    expect(outcome).toBe('banned');
    expect(await store.unban(s)).toBe(true);
    expect(await store.peek(s)).toMatchObject({ banUntilMs: 0, recentRejections: 0 });
    expect((await store.consume(s)).outcome).toBe('minute'); // the minute stays used: only the ban is lifted
    expect(await store.unban(s)).toBe(false);
  });

  it('gives back the memory of addresses whose minute is over: a client chooses its addresses', async () => {
    // Measured after a full collection: what the store holds has no other observable size.
    setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as () => void;
    const heap = () => (gc(), process.memoryUsage().heapUsed);
    let now = Date.UTC(2026, 10, 22, 10, 0, 0);
    const store = new MemoryQuotaStore(() => now);
    const before = heap();
    for (let i = 0; i < 20_000; i++) await store.consume(subject(5, 0, false));
    const held = heap() - before;
    now += 61_000;
    await store.consume(subject(5, 0, false));
    const freed = held + before - heap();
    expect(held).toBeGreaterThan(2_000_000); // some 700 bytes an address, its name included
    expect(freed).toBeGreaterThan(held * 0.9);
  });
});

describe('redis store', () => {
  it('does not extend a ban, whichever instance asks, and reports the counts it holds', async () => {
    await inOneMinute(async () => {
      const s = subject(2, 100);
      const fresh = () => new RedisQuotaStore(redis, silent); // no cached ban: every call runs the script
      for (let i = 0; i < 6; i++) await fresh().consume(s);
      const ban = Number(await redis.hget(s.name, 'ban'));
      expect(ban).toBeGreaterThan(Date.now());
      // A later call has a later Redis time: an extended ban would show a later end.
      await eventually(async () => {
        const [sec, us] = await redis.time();
        return Number(sec) * 1000 + Math.floor(Number(us) / 1000) > ban - bans.durationMs;
      });
      const d = await fresh().consume(s);
      expect(d.outcome).toBe('banned');
      expect(Number(await redis.hget(s.name, 'ban'))).toBe(ban);
      expect(d.windows.map((w) => w.used)).toEqual([2, 2]);
    });
  });

  it('keeps all the Redis keys of one consumer in one Cluster slot', async () => {
    const prefix = `slot${randomUUID().slice(0, 8)}`;
    const config = compileConfig(validateConfigFile(testConfig([{ ...makeKey('tiny'), id: 'acme' }]), 't'), prefix);
    const consumer = [...config.consumers.values()][0]!;
    const store = new RedisQuotaStore(redis, silent);
    for (let i = 0; i < 5; i++) await store.consume(consumer.subject); // admitted and refused: both keys exist
    const names = await redis.keys(`${prefix}:*`);
    // Beside the counters and the recent 429s, each call's reply, kept for a call sent again and
    // for settling one given up on: longer than a failover takes (45 s at most in reconcile-faults).
    const calls = names.filter((n) => n.startsWith(`${prefix}:production:{k:acme}:call:`));
    expect(calls).toHaveLength(5);
    expect(await redis.pttl(calls[0]!)).toBeGreaterThan(45_000);
    expect(names.filter((n) => !calls.includes(n)).sort()).toEqual([`${prefix}:production:{k:acme}`, `${prefix}:production:{k:acme}:rej`]);
    expect(new Set(names.map((n) => calculateSlot(n))).size).toBe(1);
  });

  it('takes the time from Redis, not from the gateway clock', async () => {
    const s = subject(5, 10, false);
    const store = new RedisQuotaStore(redis, silent);
    const real = Date.now();
    vi.useFakeTimers({ toFake: ['Date'], now: real + 3_600_000 }); // this gateway runs an hour fast
    try {
      const d = await store.consume(s);
      expect(Math.abs(d.nowMs - real)).toBeLessThan(2000);
      expect(Number(await redis.hget(s.name, 'ms'))).toBe(d.nowMs - (d.nowMs % MINUTE_MS));
    } finally {
      vi.useRealTimers();
    }
  });

  it('aligns windows to UTC using Redis time, and expires the counters at the end of the day', async () => {
    const store = new RedisQuotaStore(redis, silent);
    const s = subject(5, 10, false);
    const d = await store.consume(s);
    const fields = await redis.hgetall(s.name);
    expect(Number(fields.ms) % MINUTE_MS).toBe(0);
    expect(Number(fields.ds) % DAY_MS).toBe(0);
    expect(d.windows[0]!.resetMs).toBe(Number(fields.ms) + MINUTE_MS);
    expect(Math.abs(d.nowMs - Date.now())).toBeLessThan(2000);
    const pexpireAt = Number(await redis.call('PEXPIRETIME', s.name));
    expect(pexpireAt).toBe(Number(fields.ds) + DAY_MS);
  });

  it('stores only the windows a subject has: no hour fields without perHour', async () => {
    const store = new RedisQuotaStore(redis, silent);
    const plain = subject(5, 10, false);
    const hourly = { ...subject(5, 10, false), limits: { perMinute: 5, perHour: 7, perDay: 10 } };
    await store.consume(plain);
    await store.consume(hourly);
    const hourFields = async (s: QuotaSubject) => Object.keys(await redis.hgetall(s.name)).filter((f) => f === 'hs' || f === 'hc');
    expect({ plain: await hourFields(plain), hourly: (await hourFields(hourly)).sort() }).toEqual({ plain: [], hourly: ['hc', 'hs'] });
  });

  it('starts a new minute when the stored window is an old one', async () => {
    await inOneMinute(async () => {
      const store = new RedisQuotaStore(redis, silent);
      const s = subject(2, 10, false);
      expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'minute']);
      const ms = Number(await redis.hget(s.name, 'ms'));
      await redis.hset(s.name, 'ms', ms - MINUTE_MS); // as if those two were last minute
      const d = await store.consume(s);
      expect(d.windows.map((w) => w.used)).toEqual([1, 3]);
    });
  });

  it('admits exactly the limit under concurrent load from several clients', async () => {
    await inOneMinute(async () => {
      const clients = [0, 1, 2].map(() => testClient(inject('redisUrl')));
      const stores = clients.map((c) => new RedisQuotaStore(c, silent));
      const s = subject(50, 1000, false);
      const results = await Promise.all(Array.from({ length: 300 }, (_, i) => stores[i % 3]!.consume(s)));
      expect(results.filter((d) => d.outcome === 'allowed')).toHaveLength(50);
      await Promise.all(clients.map((c) => c.quit()));
    });
  });

  it('answers a known ban without a round trip, and another instance learns it from Redis', async () => {
    await inOneMinute(async () => {
      const own = testClient(inject('redisUrl'));
      const store = new RedisQuotaStore(own, silent);
      const s = subject(1, 100);
      expect(await outcomes(store, s, 5)).toContain('banned');
      own.disconnect(); // no Redis for this instance any more
      const cached = await store.consume(s);
      expect(cached.outcome).toBe('banned');
      expect(store.degraded).toBe(false);
      const other = new RedisQuotaStore(redis, silent);
      expect((await other.consume(s)).outcome).toBe('banned');
    });
  });

  it('asks Redis again about a ban once a second, one request at a time, and keeps it if Redis fails meanwhile', async () => {
    await inOneMinute(async () => {
      const own = testClient(inject('redisUrl'), { enableOfflineQueue: false });
      await eventually(() => own.status === 'ready');
      let skew = 0; // this instance's clock, moved on instead of waiting a second
      const clock = { wall: () => Date.now() + skew, mono: () => performance.now() + skew };
      const store = new RedisQuotaStore(own, silent, { clock });
      const s = subject(1, 100);
      expect(await outcomes(store, s, 5)).toContain('banned');
      skew = 2000; // the copy of the ban is now 2 s old
      own.disconnect(); // and the recheck finds Redis gone
      const [first, beside] = await Promise.all([store.consume(s), store.consume(s)]);
      // The one that rechecked met a failing Redis: the ban it knew holds, not the degraded budget.
      expect([first.outcome, beside.outcome]).toEqual(['banned', 'banned']);
      expect(store.degraded).toBe(true);
      expect(store.counts.degraded).toBe(0);
    });
  });

  it('falls back to the in-process store when Redis fails, and says so', async () => {
    const broken = unreachableRedis();
    const warnings: unknown[] = [];
    const log = { ...silent, warn: (...a: unknown[]) => warnings.push(a) } as unknown as FastifyBaseLogger;
    const store = new RedisQuotaStore(broken, log);
    const s = subject(2, 10, false);
    expect(await outcomes(store, s, 3)).toEqual(['allowed', 'allowed', 'minute']);
    expect(store.degraded).toBe(true);
    expect(warnings).toHaveLength(1);
    broken.disconnect();
  });

  it('never spends credits nor admits an exported request without Redis: such subjects are refused as unavailable while Redis fails', async () => {
    const broken = unreachableRedis();
    const store = new RedisQuotaStore(broken, silent);
    const s: QuotaSubject = {
      ...subject(100, 1000, false),
      billing: { billingDay: 1, overage: 0, credits: { grant: 10, rollover: false } },
    };
    // A decision the store makes without Redis comes without a promise, so its refusal is thrown: asked in a promise here.
    const consumed = async (x: QuotaSubject) => store.consume(x);
    await expect(consumed(s)).rejects.toBeInstanceOf(QuotaStoreUnavailable);
    expect(store.degraded).toBe(true);
    await expect(consumed(s)).rejects.toBeInstanceOf(QuotaStoreUnavailable); // declared failing: from the degraded path too
    expect((await store.consume(subject(100, 1000, false))).outcome).toBe('allowed'); // a subject without credits: its share
    // Usage events are the bill: a subject that records them is not decided without Redis either.
    await expect(consumed({ ...subject(100, 1000, false), events: 1000 })).rejects.toBeInstanceOf(QuotaStoreUnavailable);
    // Nor concurrency or burst: their bounds hold across instances only where Redis decides.
    await expect(consumed({ ...subject(100, 1000, false), short: { concurrent: 10 } })).rejects.toBeInstanceOf(QuotaStoreUnavailable);
    await expect(consumed({ ...subject(100, 1000, false), short: { burst: { size: 5, perSecond: 1 } } })).rejects.toBeInstanceOf(
      QuotaStoreUnavailable,
    );
    broken.disconnect();
  });

  it('logs and counts a refund Redis does not take: the request stays counted', async () => {
    const own = testClient(inject('redisUrl'), { enableOfflineQueue: false });
    await eventually(() => own.status === 'ready');
    const warnings: unknown[][] = [];
    const log = { ...silent, warn: (...a: unknown[]) => warnings.push(a) } as unknown as FastifyBaseLogger;
    const store = new RedisQuotaStore(own, log);
    const s = subject(5, 10, false);
    const d = await store.consume(s);
    own.disconnect(); // gone before the refund, and no call has told the store yet
    await store.refund(s, d.nowMs);
    expect(store.counts.refundsFailed).toBe(1);
    expect(warnings.map((w) => w[1])).toEqual(['quota store: a refund failed; the request stays counted']);
    expect(await redis.hget(s.name, 'mc')).toBe('1');
  });

  it('writes back what an instance admitted while Redis failed once per batch, into the windows still current', async () => {
    const store = new RedisQuotaStore(redis, silent); // defines the script on the client
    const client = redis as unknown as { writeback(...a: unknown[]): Promise<number> };
    await inOneMinute(async () => {
      const s = subject(100, 1000, false);
      const [sec] = await redis.time();
      const now = Number(sec) * 1000;
      const [ms, ds] = [now - (now % MINUTE_MS), now - (now % DAY_MS)];
      await redis.hset(s.name, 'ms', ms, 'mc', 7, 'ds', ds, 'dc', 40);
      expect(
        await client.writeback(
          ...writeBackArgs({
            name: s.name,
            id: 'inst-a:1',
            starts: { minute: ms, day: ds },
            units: { minute: 3, day: 5 },
            longestMs: DAY_MS,
            periodStart: 0,
            periodEnd: 0,
            periodUnits: 0,
          }),
        ),
      ).toBe(1);
      expect(
        await client.writeback(
          ...writeBackArgs({
            name: s.name,
            id: 'inst-a:1',
            starts: { minute: ms, day: ds },
            units: { minute: 3, day: 5 },
            longestMs: DAY_MS,
            periodStart: 0,
            periodEnd: 0,
            periodUnits: 0,
          }),
        ),
      ).toBe(0); // a retry: nothing more
      expect(
        await client.writeback(
          ...writeBackArgs({
            name: s.name,
            id: 'inst-b:1',
            starts: { minute: ms - MINUTE_MS, day: ds },
            units: { minute: 2, day: 2 },
            longestMs: DAY_MS,
            periodStart: 0,
            periodEnd: 0,
            periodUnits: 0,
          }),
        ),
      ).toBe(1); // an old minute: the day only
      expect(await redis.hmget(s.name, 'mc', 'dc')).toEqual(['10', '47']);
      expect(Number(await redis.call('PEXPIRETIME', s.name))).toBe(ds + DAY_MS);
    });
    await store.close();
  });

  it("adds the day's written-back units to the billing period they were admitted in, and starts a later period afresh", async () => {
    const store = new RedisQuotaStore(redis, silent);
    const client = redis as unknown as { writeback(...a: unknown[]): Promise<number> };
    const s = subject(100, 1000, false);
    const [sec] = await redis.time();
    const now = Number(sec) * 1000;
    const [ms, ds] = [now - (now % MINUTE_MS), now - (now % DAY_MS)];
    const [older, stored, later] = [ds - 40 * DAY_MS, ds - 10 * DAY_MS, ds - DAY_MS];
    await redis.hset(s.name, 'ps', stored, 'pc', 30);
    const periodEnd = ds + 20 * DAY_MS;
    expect(
      await client.writeback(
        ...writeBackArgs({
          name: s.name,
          id: 'i:1',
          starts: { minute: ms, day: ds },
          units: { minute: 3, day: 3 },
          longestMs: DAY_MS,
          periodStart: stored,
          periodEnd: periodEnd,
          periodUnits: 3,
        }),
      ),
    ).toBe(1);
    expect(await redis.hmget(s.name, 'ps', 'pc')).toEqual([String(stored), '33']);
    // The hash holds the period's count: it lasts the period, not the day.
    expect(Number(await redis.call('PEXPIRETIME', s.name))).toBe(periodEnd);
    expect(
      await client.writeback(
        ...writeBackArgs({
          name: s.name,
          id: 'i:2',
          starts: { minute: ms, day: ds },
          units: { minute: 2, day: 2 },
          longestMs: DAY_MS,
          periodStart: older,
          periodEnd: older + 30 * DAY_MS,
          periodUnits: 2,
        }),
      ),
    ).toBe(1); // an earlier period: over
    expect(await redis.hmget(s.name, 'ps', 'pc')).toEqual([String(stored), '33']);
    expect(
      await client.writeback(
        ...writeBackArgs({
          name: s.name,
          id: 'i:3',
          starts: { minute: ms, day: ds },
          units: { minute: 4, day: 4 },
          longestMs: DAY_MS,
          periodStart: later,
          periodEnd: later + 30 * DAY_MS,
          periodUnits: 4,
        }),
      ),
    ).toBe(1); // a later one starts afresh
    expect(await redis.hmget(s.name, 'ps', 'pc')).toEqual([String(later), '4']);
    await store.close();
  });
});

/**
 * The script calls a store makes on the real client, as they go to Redis: their arguments,
 * and the most in flight at once. (After the store is built: it defines the command.)
 */
function watchQuotaCalls(client: Redis) {
  const target = client as unknown as { quota: (...a: unknown[]) => Promise<unknown> };
  const quota = target.quota.bind(client);
  const seen = { args: [] as unknown[][], inFlight: 0, most: 0 };
  target.quota = async (...a) => {
    seen.args.push(a);
    seen.most = Math.max(seen.most, ++seen.inFlight);
    try {
      return await quota(...a);
    } finally {
      seen.inFlight--;
    }
  };
  return seen;
}

describe('redis store with leases', () => {
  // The store alone (no gateway settings): leases of up to 20, so a key of 1,000 a minute takes 10.
  const leased = (client: Redis = redis, max = 20) => new RedisQuotaStore(client, silent, { leaseMax: max });
  const counted = async (s: QuotaSubject) => Number(await redis.hget(s.name, 'mc'));

  it('takes 1% of the limit in one call, hands it out itself, and takes the next lease once half is out', async () => {
    await inOneMinute(async () => {
      const store = leased();
      const s = subject(1000, 100000, false); // a lease is 10 units
      const first = await store.consume(s);
      expect(await counted(s)).toBe(10);
      const rest = [];
      for (let i = 0; i < 3; i++) rest.push(await store.consume(s));
      expect(await counted(s)).toBe(10); // no call for these three
      rest.push(await store.consume(s)); // five of ten handed out: the next lease is asked for, ahead
      await eventually(async () => (await counted(s)) === 20, 2000, 'the next lease taken');
      for (let i = 0; i < 5; i++) rest.push(await store.consume(s));
      expect(rest.every((d) => d.outcome === 'allowed')).toBe(true);
      // The headers count the whole lease as used: never more room than Redis holds.
      expect([first, ...rest].every((d) => d.windows[0]!.used === 10)).toBe(true);
      const fromNext = await store.consume(s); // the first lease is out: the one taken ahead, no call
      expect(fromNext.windows[0]!.used).toBe(20);
      expect(await counted(s)).toBe(20);
    });
  });

  it("decides a unit of a lease and a known ban without a promise, and shares a lease's decision within a second", async () => {
    await inOneMinute(async () => {
      // A store built alone has no gateway settings, so `leased()` gives it its lease size: 10 units
      // at 1,000 a minute, as the shipped QUOTA_LEASE_MAX (100) gives too.
      const store = leased();
      const s = subject(1000, 100000, false); // a lease is 10 units
      const first = store.consume(s);
      expect(first).toBeInstanceOf(Promise); // no lease yet: Redis decides
      await first;
      // Three in a row take microseconds: at most one second boundary falls between them.
      const units = [store.consume(s), store.consume(s), store.consume(s)];
      for (const u of units) expect(u).not.toBeInstanceOf(Promise);
      const [a, b, c] = units as Decision[];
      const second = (d: Decision) => Math.floor(d.nowMs / 1000);
      const sameSecond = [
        [a!, b!],
        [b!, c!],
      ].filter(([x, y]) => second(x!) === second(y!));
      expect(sameSecond.length).toBeGreaterThan(0);
      for (const [x, y] of sameSecond) expect(x).toBe(y);

      const banned = subject(1, 100); // bans after 3 refusals
      expect(await outcomes(store, banned, 5)).toEqual(['allowed', 'minute', 'minute', 'minute', 'banned']);
      const known = store.consume(banned); // the ban is known here: no call
      expect(known).not.toBeInstanceOf(Promise);
      expect((known as Decision).outcome).toBe('banned');
    });
  });

  it('with steady traffic, only the first request waits on Redis: every later lease is taken ahead', async () => {
    await inOneMinute(async () => {
      const client = testClient(inject('redisUrl'));
      try {
        const store = leased(client);
        const calls = watchQuotaCalls(client);
        const s = subject(1000, 100000, false); // leases of 10
        for (let i = 0; i < 60; i++) {
          expect((await store.consume(s)).outcome).toBe('allowed');
          // Steady traffic: the next request comes once a call taken ahead has landed, as it does
          // when requests are further apart than a round trip to Redis (on a loaded machine, a
          // fixed pause may be shorter than that).
          await eventually(() => calls.inFlight === 0, 2000, 'the call ahead landed');
        }
        const kinds = calls.args.map((a) => (quotaArg(a, 'refill') === 1 ? 'ahead' : 'asked'));
        expect(kinds[0]).toBe('asked');
        expect(kinds.slice(1)).toEqual(Array(kinds.length - 1).fill('ahead'));
        // 60 requests, six leases handed out; the sixth's half-way point took a seventh ahead.
        expect(kinds.length).toBe(7);
        await eventually(async () => (await counted(s)) === 70, 2000, 'the seventh lease counted'); // sent ahead, maybe not run yet
      } finally {
        await client.quit();
      }
    });
  });

  it('takes nothing ahead near the limit, and a lease taken ahead is never a refusal', async () => {
    await inOneMinute(async () => {
      const client = testClient(inject('redisUrl'));
      try {
        const store = leased(client);
        const calls = watchQuotaCalls(client);
        const s = subject(1000, 100000, true); // leases of 10; bans on
        const [sec] = await redis.time();
        await redis.hset(s.name, 'ms', Number(sec) * 1000 - ((Number(sec) * 1000) % MINUTE_MS), 'mc', 975);
        const got: string[] = [];
        for (let i = 0; i < 26; i++) {
          got.push((await store.consume(s)).outcome);
          await eventually(() => calls.inFlight === 0, 2000, 'a call ahead, if any, landed'); // before the next request
        }
        // 25 of room: a lease of 10 (room 15 after it: less than two leases, so nothing ahead),
        // then one decision per request; exactly the limit, one refusal.
        expect(got.filter((o) => o === 'allowed')).toHaveLength(25);
        expect(got.at(-1)).toBe('minute');
        expect(await counted(s)).toBe(1000);
        expect(await redis.llen(`${s.name}:rej`)).toBe(1); // the refusal; nothing from the call ahead
      } finally {
        await client.quit();
      }
    });
  });

  it('takes no lease below 200 a window, nor when the window has room for less than two leases', async () => {
    await inOneMinute(async () => {
      const small = subject(199, 100000, false);
      await leased().consume(small);
      expect(await counted(small)).toBe(1);
      const s = subject(1000, 100000, false);
      const [sec] = await redis.time();
      await redis.hset(s.name, 'ms', Number(sec) * 1000 - ((Number(sec) * 1000) % MINUTE_MS), 'mc', 981);
      await leased().consume(s); // 19 left: less than two leases of 10
      expect(await counted(s)).toBe(982);
    });
  });

  it('asks Redis once at a time per subject, so concurrent requests do not each reserve a lease', async () => {
    await inOneMinute(async () => {
      const one = leased();
      const s = subject(1000, 100000, false); // leases of 10
      const results = await Promise.all(Array.from({ length: 95 }, () => one.consume(s)));
      expect(results.every((d) => d.outcome === 'allowed')).toBe(true);
      expect(await counted(s)).toBe(110); // ten leases for 95 requests and the next taken ahead, not 95 leases
      // Without the one-at-a-time rule it would be as if each request were its own instance:
      const apart = subject(1000, 100000, false);
      await Promise.all(Array.from({ length: 95 }, () => leased().consume(apart)));
      expect(await counted(apart)).toBe(950);
    });
  });

  it('never admits past the limit across instances; what one holds is under-admission, not a loss', async () => {
    await inOneMinute(async () => {
      const clients = [0, 1].map(() => testClient(inject('redisUrl')));
      try {
        const [a, b] = clients.map((c) => leased(c, 5));
        const s = subject(500, 100000, false); // leases of 5
        expect((await a!.consume(s)).outcome).toBe('allowed'); // a holds 4 more
        let admittedByB = 0;
        while ((await b!.consume(s)).outcome === 'allowed') admittedByB++;
        expect(admittedByB).toBe(495); // the 4 units a holds are not b's to give: under by lease - 1
        const fromA = await Promise.all(Array.from({ length: 6 }, () => a!.consume(s)));
        expect(fromA.map((d) => d.outcome)).toEqual(['allowed', 'allowed', 'allowed', 'allowed', 'minute', 'minute']);
        expect(await counted(s)).toBe(500);
      } finally {
        await Promise.all(clients.map((c) => c.quit()));
      }
    });
  });

  it('gives the unused units of an expired lease back to the day, with the next call', async () => {
    const store = leased();
    const s = subject(1000, 100000, false); // leases of 10
    await store.consume(s); // one unit used, nine held
    expect(Number(await redis.hget(s.name, 'dc'))).toBe(10);
    const realNow = performance.now();
    vi.useFakeTimers({ toFake: ['performance'] });
    try {
      vi.advanceTimersByTime(realNow + 61_000); // the lease's minute is over, for this instance
      await store.consume(s); // gives the nine back, then takes a new lease of 10
    } finally {
      vi.useRealTimers();
    }
    expect(Number(await redis.hget(s.name, 'dc'))).toBe(11); // 1 + 10, not 10 + 10
  });

  it('does not queue requests behind each other when no lease comes', async () => {
    await inOneMinute(async () => {
      const client = testClient(inject('redisUrl'));
      try {
        const store = leased(client);
        const calls = watchQuotaCalls(client);
        const s = subject(1000, 100000, false);
        const [sec] = await redis.time();
        await redis.hset(s.name, 'ms', Number(sec) * 1000 - ((Number(sec) * 1000) % MINUTE_MS), 'mc', 985);
        // 15 of room, less than two leases: the first call brings no lease, and the others then
        // ask together, one unit each, instead of one after the other.
        const results = await Promise.all(Array.from({ length: 20 }, () => store.consume(s)));
        expect(results.filter((d) => d.outcome === 'allowed')).toHaveLength(15);
        expect(await counted(s)).toBe(1000);
        expect(calls.most).toBeGreaterThan(1);
      } finally {
        await client.quit();
      }
    });
  });
});

/** A client of a Redis that is not there (port 1): every call fails at once, never retried. */
function unreachableRedis(): Redis {
  return testClient('redis://127.0.0.1:1', {
    enableOfflineQueue: false,
    maxRetriesPerRequest: 0,
    retryStrategy: () => null,
    lazyConnect: true,
  });
}
