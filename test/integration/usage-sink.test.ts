import type { FastifyBaseLogger } from 'fastify';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, inject, it, onTestFinished } from 'vitest';
import { compileConfig, type ConfigFile, type GatewayConfig, validateConfigFile } from '../../gateway/config/config.js';
import type { EventTag, QuotaSubject } from '../../gateway/quota/decision.js';
import { RedisQuotaStore } from '../../gateway/quota/redis/store.js';
import { activityMarks } from '../../gateway/usage/active.js';
import type { CloudEvent, EncodedEvent } from '../../gateway/usage/events.js';
import { UsageExporter } from '../../gateway/usage/exporter.js';
import { ALL_ACCEPTED, type Accepted, type UsageSink } from '../../gateway/usage/sink.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { makeKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { eventually } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

// The sink seam (usage/sink.ts): the exporter hands a second sink, our own, exactly the batches
// it reads from real Redis streams, and moves no cursor past a batch the sink refused.

/** A sink that keeps what it accepts in an array, and refuses while `refusing` is set. */
class ArraySink implements UsageSink {
  readonly name = 'array sink';
  readonly batches: CloudEvent[][] = [];
  offered = 0;
  refusing?: { reason: string; retryAfterMs?: number };

  async deliver(batch: readonly EncodedEvent[]): Promise<Accepted> {
    this.offered++;
    if (this.refusing) return { accepted: 'none', ...this.refusing };
    // A part is one event or a bundle's, as a JSON array's elements.
    this.batches.push(batch.flatMap((e) => JSON.parse(`[${e}]`) as CloudEvent[]));
    return ALL_ACCEPTED;
  }

  requestIds(): string[] {
    return this.batches.flat().map((e) => e.data.requestId as string);
  }
}

type Line = Record<string, unknown> & { msg: string };

/** The exporter's log lines, kept to read (pino's shape: the object, then the message). */
function logLines(): { log: FastifyBaseLogger; lines: Line[] } {
  const lines: Line[] = [];
  const keep = (obj: object, msg: string) => void lines.push({ ...obj, msg });
  const log = { info: keep, warn: keep, error: keep, debug: keep } as unknown as FastifyBaseLogger;
  return { log, lines };
}

const BATCH = 5;
const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };

let redis: Redis;
beforeAll(() => {
  redis = testClient(inject('redisUrl'));
});
afterAll(() => redis.quit());

/**
 * A deployment of one key with usage export on (a URL nobody is asked: the sink is the test's),
 * under a fresh prefix; `leaseMax` as the store's option. 1 (no lease) unless a test says
 * otherwise, in place of the shipped QUOTA_LEASE_MAX: these tests follow quota.lua's own events
 * (one stream entry a request, its status joined afterwards) through the sink seam, which a
 * lease would replace with a bundle written only at the batch interval; the bundles have the
 * test below that runs at the shipped lease.
 */
function deployment(leaseMax = 1): { config: GatewayConfig; subject: QuotaSubject; store: RedisQuotaStore } {
  const file = testConfig([makeKey('metered')], {
    plans,
    usage: { export: { url: 'http://127.0.0.1:9/never-called', maxEvents: 1000, batchSize: BATCH } },
  });
  const config = compileConfig(validateConfigFile(file, 'test config'), uniquePrefix());
  const store = new RedisQuotaStore(redis, logLines().log, { marks: activityMarks(redis, () => config), leaseMax });
  onTestFinished(() => store.close());
  return { config, subject: [...config.accounts.values()][0]!, store };
}

/** `n` admitted requests with their events and final statuses in Redis, as the gateway writes them; their request ids. */
async function requests(d: ReturnType<typeof deployment>, n: number): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < n; i++) {
    const requestId = `req-${i}-${uniquePrefix()}`;
    const tag: EventTag = { requestId, keyId: 'k', plan: 'metered', route: 'listPets', method: 'GET' };
    await d.store.consume(d.subject, 1, tag);
    expect(tag.eventId).toBeTruthy();
    d.store.recordStatus(d.subject, tag.eventId!, 200);
    ids.push(requestId);
  }
  // Every status written: an event waiting for its status would end a batch early.
  await eventually(async () => (await redis.hlen(`${d.subject.name}:statuses`)) === n, 5000, 'the statuses written');
  return ids;
}

/** The exporter as the wiring builds it, with the test's sink, on a connection of its own. */
function exporter(config: GatewayConfig, sink: UsageSink, log: FastifyBaseLogger) {
  const own = testClient(inject('redisUrl'));
  const counted = { exported: 0, failed: 0 };
  const metrics = {
    exported: (n: number) => void (counted.exported += n),
    failed: () => void counted.failed++,
    dropped: () => {},
    rejected: () => {},
    duplicates: () => {},
    lag: () => {},
    round: () => {},
  };
  const loop = new UsageExporter({ redis: own, config: () => config, log, metrics, sink: () => sink });
  onTestFinished(async () => {
    loop.stop();
    await own.quit();
  });
  return { loop, counted };
}

describe('a second usage sink', () => {
  it('receives exactly the batches read from the streams, in order, each within the batch size, and the cursors move past them', async () => {
    // No lease (deployment()): quota.lua's own events, one stream entry a request, are what this follows to the sink.
    const d = deployment();
    const ids = await requests(d, 12);
    const sink = new ArraySink();
    const { loop, counted } = exporter(d.config, sink, logLines().log);
    loop.start();
    await eventually(async () => (await d.store.exportState(d.subject)).exported === 12, 20_000, 'every event exported');
    expect(sink.requestIds()).toEqual(ids);
    expect(sink.batches.map((b) => b.length)).toEqual([5, 5, 2]);
    expect(sink.batches.flat().map((e) => [e.type, e.data.status])).toEqual(ids.map(() => ['com.petstore.gateway.request', 200]));
    expect(await d.store.exportState(d.subject)).toEqual({ exported: 12, pending: 0, dropped: 0, rejected: 0, unsettled: 0 }); // no lease: leaseMax 1
    expect(counted).toEqual({ exported: 12, failed: 0 });
    // The statuses these events joined went with their cursor's move: none left to grow with the traffic.
    expect(await redis.hlen(`${d.subject.name}:statuses`)).toBe(0);
  });

  it("splits a bundle larger than the batch size into batches within it, the bundle's events in order", async () => {
    // Leases (the shipped QUOTA_LEASE_MAX, in the store's option, as the wiring passes it): the
    // admissions' events go to Redis in one bundle when the store closes.
    const d = deployment(loadSettings({}).quotaLeaseMax);
    const ids: string[] = [];
    for (let i = 0; i < 12; i++) {
      const tag: EventTag = { requestId: `req-${i}-${uniquePrefix()}`, keyId: 'k', plan: 'metered', route: 'listPets', method: 'GET' };
      expect((await d.store.consume(d.subject, 1, tag)).outcome).toBe('allowed');
      d.store.recordStatus(d.subject, tag.eventId!, 200);
      ids.push(tag.requestId);
    }
    await d.store.close();
    const bundles = await redis.xrange(`${d.subject.name}:bundles`, '-', '+');
    expect(bundles.map(([, f]) => f[1])).toEqual(['12']); // one bundle (`n 12 ...`): the call that took the lease admitted the first
    const sink = new ArraySink();
    const { loop } = exporter(d.config, sink, logLines().log);
    loop.start();
    await eventually(async () => (await d.store.exportState(d.subject)).exported === 12, 20_000, 'every event exported');
    expect(sink.batches.map((b) => b.length)).toEqual([5, 5, 2]);
    expect(sink.requestIds()).toEqual(ids);
  });

  it('that refuses leaves the cursors where they were, and gets the same events again once it accepts', async () => {
    // No lease (deployment()): quota.lua's own events, one stream entry a request, are what this follows to the sink.
    const d = deployment();
    const ids = await requests(d, 4);
    const sink = new ArraySink();
    sink.refusing = { reason: 'the test sink is full' };
    const { log, lines } = logLines();
    const { loop, counted } = exporter(d.config, sink, log);
    loop.start();
    // Refused twice (the second offer comes after the first refusal's backoff), or a cursor moved anyway.
    const exported = async () => (await d.store.exportState(d.subject)).exported;
    await eventually(async () => sink.offered >= 2 || (await exported()) > 0, 20_000, 'the batch offered twice');
    expect(await d.store.exportState(d.subject)).toEqual({ exported: 0, pending: 4, dropped: 0, rejected: 0, unsettled: 0 });
    expect(counted.exported).toBe(0);
    expect(counted.failed).toBeGreaterThanOrEqual(2);
    const failed = lines.find((l) => l.msg === 'usage export: a batch failed');
    expect(failed).toMatchObject({ sink: 'array sink', cause: 'the test sink is full' });
    sink.refusing = undefined;
    await eventually(async () => (await exported()) === 4, 20_000, 'the events exported');
    expect(sink.requestIds()).toEqual(ids);
    // Said once the round that moved the cursors returns: a little after they moved.
    await eventually(() => lines.some((l) => l.msg === 'usage export: the sink takes events again'), 5000, 'the recovery line');
  });

  it("that refuses with a retry hint is waited for as long as it asked (within the backoff's 30 s ceiling)", async () => {
    // No lease (deployment()): quota.lua's own events, one stream entry a request, are what this follows to the sink.
    const d = deployment();
    await requests(d, 1);
    const sink = new ArraySink();
    sink.refusing = { reason: 'slow down', retryAfterMs: 20_000 };
    const { log, lines } = logLines();
    const { loop } = exporter(d.config, sink, log);
    loop.start();
    await eventually(() => lines.some((l) => l.msg === 'usage export: a batch failed'), 20_000, 'the refusal logged');
    // The first failure's own backoff is at most 0.5 s: the wait logged is the sink's.
    expect(lines.find((l) => l.msg === 'usage export: a batch failed')).toMatchObject({ cause: 'slow down', retryInMs: 20_000 });
  });
});
