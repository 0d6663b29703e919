import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { FastifyBaseLogger } from 'fastify';
import { describe, expect, it, onTestFinished } from 'vitest';
import { compileConfig, type ConfigFile, validateConfigFile } from '../../gateway/config/config.js';
import { loadSettings } from '../../gateway/config/settings.js';
import type { EventTag } from '../../gateway/quota/decision.js';
import { EventBatches, statusWait } from '../../gateway/quota/redis/event-batches.js';
import { RedisQuotaStore } from '../../gateway/quota/redis/store.js';
import { activityMarks } from '../../gateway/usage/active.js';
import { UsageExporter } from '../../gateway/usage/exporter.js';
import { HttpCloudEventsSink } from '../../gateway/usage/http-sink.js';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, tempDir, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { startProcess } from '../helpers/processes.js';
import { spawnRedis, testClient } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { eventually, sleep } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// Issue 34, item 2: an exporting key is leased like any other; its admissions' events are
// written by their instance in batches (usagebatch.lua), with their statuses, once each. A
// unit leased and never written as an event stays in the account's `unsettled`, so the
// reconcile adds up: what the windows counted = events written (net of refunds) + unsettled.

const TOKEN = 'export-leases-0123456789';
// 1% of 200: leases of 2 units (docs/reference.md, Leases), and no lease taken ahead of need
// (that waits for half of a lease to be handed out, and a unit is, at once, to the request that
// asked): an instance that answered an even number of requests, one at a time, holds none.
const plans: ConfigFile['plans'] = { leased: { perMinute: 200, perDay: 100_000 } };

interface Answer {
  rid: string;
  via: 'A' | 'B';
  status: number;
}

interface Usage {
  windows: { day: { used: number } };
  events: { exported: number; pending: number; dropped: number; unsettled: number };
}

/**
 * Waits, if need be, for a Redis minute with 30 s left: a lease lives within its minute, and a
 * unit left when the minute ends is never handed out (counted in `unsettled` if its instance
 * dies before closing it), which would blur "unsettled = the events lost" by that unit.
 */
async function roomInTheMinute(url: string) {
  const redis = testClient(url);
  const [s, us] = await redis.time();
  redis.disconnect();
  const left = 60_000 - ((Number(s) * 1000 + Math.floor(Number(us) / 1000)) % 60_000);
  if (left < 30_000) await sleep(left + 50); // the next minute's start on Redis's clock
}

async function setUp(extraEnv: Record<string, string> = {}) {
  const redis = await spawnRedis();
  onTestFinished(() => redis.stop());
  const sink = await startSink();
  onTestFinished(() => sink.close());
  const echo = await echoBackend();
  onTestFinished(() => echo.close());
  const dir = tempDir();
  onTestFinished(() => dir.cleanup());
  const key = makeKey('leased');
  const file = join(dir.dir, 'gateway.json');
  writeFileSync(
    file,
    JSON.stringify(testConfig([key], { plans, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 100 } } })),
  );
  const env = {
    REDIS_URL: redis.url,
    GATEWAY_CONFIG: file,
    BACKEND_URL: echo.url,
    REDIS_KEY_PREFIX: uniquePrefix(),
    GATEWAY_PORT: '0',
    ADMIN_PORT: '0',
    ADMIN_TOKEN: TOKEN,
    ...extraEnv,
  };
  const start = async () => {
    const proc = await startProcess('dist/gateway/server.js', env, (l) => l.msg === 'gateway ready');
    onTestFinished(() => proc.stop().then(() => undefined));
    const ready = proc.logs.find((l) => l.msg === 'gateway ready')!;
    return { proc, url: String(ready.address), admin: String(ready.admin) };
  };
  const [A, B] = await Promise.all([start(), start()]);
  return { redis, sink, echo, key, A: A!, B: B! };
}

/**
 * One test gateway with a Redis of its own (a test may freeze it) and a sink, exporting a key of
 * the leased plan; `settings` as each test says why.
 */
async function leasedGateway(settings: Parameters<typeof buildTestGateway>[0]['settings'] = {}) {
  const redis = await spawnRedis();
  onTestFinished(() => redis.stop());
  const sink = await startSink();
  onTestFinished(() => sink.close());
  const key = makeKey('leased');
  const gw = await buildTestGateway({
    config: testConfig([key], { plans, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 100 } } }),
    redis: redis.url,
    settings,
  });
  onTestFinished(() => gw.close());
  const subject = [...gw.gateway.config().consumers.values()].find((c) => c.id === key.id)!.subject;
  return { redis, sink, key, gw, subject };
}

describe('usage export with leases, two gateway processes', () => {
  it('writes every event once with its status; the events a SIGKILLed instance lost are exactly the unsettled units', {
    // Up to 30 s for a roomy minute, the export leader's lock lapsing if B led it (15 s), and the export's rounds.
    timeout: scaled(120_000),
  }, async () => {
    // Batches every 10 s (the most USAGE_BATCH_MS allows) rather than every second: B is killed
    // after six requests and before its next batch, which a loaded machine could let come first.
    const { redis, sink, echo, key, A, B } = await setUp({ USAGE_BATCH_MS: '10000' });
    const answers: Answer[] = [];
    const send = async (via: 'A' | 'B', path = '/v1/pets') => {
      const rid = `${key.id}.${answers.length}`;
      const res = await call(`${(via === 'A' ? A : B).url}${path}`, key.key, { headers: { 'x-request-id': rid } });
      await res.arrayBuffer();
      answers.push({ rid, via, status: res.status });
    };
    const atSink = () =>
      new Map(
        sink
          .requests()
          .filter((e) => e.subject === key.id)
          .map((e) => [String(e.data!.requestId), e]),
      );
    await roomInTheMinute(redis.url);

    // Six requests through each instance: a 404 and a 502 (refunded) among A's.
    for (let i = 0; i < 6; i++) {
      await send('B');
      if (i === 2) await send('A', '/v1/nope');
      else if (i === 4) {
        const answer = echo.answer;
        echo.answer = (_req, res) => res.socket?.destroy();
        await send('A');
        echo.answer = answer;
      } else await send('A');
    }
    await eventually(() => atSink().size === 12, 20_000, 'the first twelve events at the sink');

    // Six more through B, then B frozen and killed before its next batch: their events die with it.
    const before = answers.length;
    for (let i = 0; i < 6; i++) await send('B');
    B.proc.proc.kill('SIGSTOP');
    const exited = new Promise((r) => B.proc.proc.once('exit', r));
    B.proc.proc.kill('SIGKILL');
    await exited;
    const lastOfB = answers.slice(before).map((a) => a.rid);

    // A serves on; its events reach the sink (the lead passes to A if B held it).
    for (let i = 0; i < 4; i++) await send('A');
    const ofA = answers.filter((a) => a.via === 'A').map((a) => a.rid);
    await eventually(() => ofA.every((rid) => atSink().has(rid)), scaled(40_000), "every event of A's at the sink");
    const usageOf = async () =>
      (await (await fetch(`${A.admin}/admin/accounts/${key.id}/usage`, { headers: { authorization: `Bearer ${TOKEN}` } })).json()) as Usage;
    await eventually(async () => (await usageOf()).events.pending === 0, 20_000, 'the stream sent');

    expect(answers.map((a) => a.status).sort()).toEqual([...Array(20).fill(200), 404, 502]);
    const events = atSink();
    const requests = sink.requests().filter((e) => e.subject === key.id);
    // Once each: no request has two events, and the sink was sent nothing twice.
    expect(requests).toHaveLength(events.size);
    // Every event written carries its request's final status.
    expect(answers.filter((a) => events.has(a.rid) && events.get(a.rid)!.data!.status !== a.status)).toEqual([]);
    // Lost: only B's last requests, answered after its last batch.
    const lost = answers.filter((a) => !events.has(a.rid)).map((a) => a.rid);
    expect(lost.length).toBeGreaterThan(0);
    expect(lastOfB).toEqual(expect.arrayContaining(lost));
    // The 502's refund is in its batch, referring to its event.
    const refunds = [...sink.events.values()].filter((e) => e.subject === key.id && e.type === 'com.petstore.gateway.request.refunded');
    const failed = answers.find((a) => a.status === 502)!;
    expect(refunds.map((e) => e.data!.refundOf)).toEqual([events.get(failed.rid)!.id]);

    const usage = await usageOf();
    expect(usage.events).toEqual({ exported: events.size + 1, pending: 0, dropped: 0, rejected: 0, unsettled: lost.length });
    // What the windows counted: every answer but the refunded one; = events written net of refunds + unsettled.
    expect(usage.windows.day.used).toBe(answers.length - 1);
    expect(usage.windows.day.used).toBe(events.size - 1 + usage.events.unsettled);
  });
});

describe('a leased admission refunded, its instance SIGKILLed before its batch', () => {
  it('keeps the unit counted and unsettled: day = events written net of refunds + unsettled, exactly', {
    timeout: scaled(60_000),
  }, async () => {
    // USAGE_BATCH_MS at its largest (10 s, not the shipped 1 s): the kill must come before B's
    // first batch, and 10 s is far more than the two requests and the kill take.
    const { redis, echo, key, A, B } = await setUp({ USAGE_BATCH_MS: '10000' });
    await roomInTheMinute(redis.url);
    // Through B: a 200, then a 502 (the backend resets the connection): one lease of 2, both units handed out.
    const statuses: number[] = [];
    const send = async () => {
      const res = await call(`${B.url}/v1/pets`, key.key);
      await res.arrayBuffer();
      statuses.push(res.status);
    };
    await send();
    const answer = echo.answer;
    echo.answer = (_req, res) => res.socket?.destroy();
    await send();
    echo.answer = answer;
    expect(statuses).toEqual([200, 502]);
    const exited = new Promise((r) => B.proc.proc.once('exit', r));
    B.proc.proc.kill('SIGKILL');
    await exited;

    const res = await fetch(`${A.admin}/admin/accounts/${key.id}/usage`, { headers: { authorization: `Bearer ${TOKEN}` } });
    const usage = (await res.json()) as Usage;
    // Neither event reached Redis, so the 502's unit was never given back: both units stay in the day and in unsettled.
    expect({ day: usage.windows.day.used, events: usage.events }).toEqual({
      day: 2,
      events: { exported: 0, pending: 0, dropped: 0, rejected: 0, unsettled: 2 },
    });
  });
});

describe('a leased admission the gateway answers 504 after a long wait on the backend', () => {
  it(
    'is refunded in its batch: its event waits for the status as long as a request may live',
    async () => {
      // UPSTREAM_TIMEOUT_MS at 13 s (shipped: 10 s): the 504 then comes well after 10 s, how long
      // an event once waited for its status; the event must still be open to take the refund.
      const { redis, sink, key, gw, subject } = await leasedGateway({ upstreamTimeoutMs: 13_000 });
      await roomInTheMinute(redis.url);
      gw.echo!.answer = () => {}; // never answers: the gateway's own timeout ends the request
      const res = await gw.call('/v1/pets', key.key);
      await res.arrayBuffer();
      expect(res.status).toBe(504);
      const rid = res.headers.get('x-request-id');
      await eventually(
        async () => sink.requests().length === 1 && (await gw.gateway.store.exportState!(subject)).pending === 0,
        20_000,
        'the event at the sink',
      );
      const [event] = sink.requests();
      const refunds = [...sink.events.values()].filter((e) => e.type === 'com.petstore.gateway.request.refunded');
      expect({ rid: event!.data!.requestId, status: event!.data!.status, refundOf: refunds.map((e) => e.data!.refundOf) }).toEqual({
        rid,
        status: 504,
        refundOf: [event!.id],
      });
      // The lease's other unit, not handed out, is the day's one count: events net of refunds (0) + unsettled.
      const { dayUsed } = await gw.gateway.store.peek(subject);
      expect({ dayUsed, state: await gw.gateway.store.exportState!(subject) }).toEqual({
        dayUsed: 1,
        state: { exported: 2, pending: 0, dropped: 0, rejected: 0, unsettled: 1 },
      });
    },
    scaled(60_000),
  );
});

describe('a batch Redis runs after its instance gave up on it', () => {
  it(
    'is written once: sent again with its id while Redis is frozen, it writes nothing the second time',
    async () => {
      const { redis, sink, key, gw, subject } = await leasedGateway(); // its own Redis, so this test can freeze it
      await roomInTheMinute(redis.url);
      // Two requests: one lease of 2, both its units handed out; their events wait for the batch.
      const rids: string[] = [];
      for (let i = 0; i < 2; i++) {
        const res = await gw.call('/v1/pets', key.key);
        expect(res.status).toBe(200);
        await res.arrayBuffer();
        rids.push(res.headers.get('x-request-id')!);
      }
      redis.proc.kill('SIGSTOP');
      await gw.waitForLog((l) => l.msg === 'usage events: a batch was not written; it is sent again' && Number(l.attempts) >= 2, 15_000);
      redis.proc.kill('SIGCONT'); // Redis runs every send it holds: the batch's first, then its resends
      await eventually(
        async () => sink.requests().length >= 2 && (await gw.gateway.store.exportState!(subject)).pending === 0,
        20_000,
        'the batch at the sink',
      );
      expect(sink.requests().map((e) => e.data!.requestId)).toEqual(rids);
      expect(sink.requests().map((e) => e.data!.status)).toEqual([200, 200]);
      expect(await gw.gateway.store.exportState!(subject)).toEqual({ exported: 2, pending: 0, dropped: 0, rejected: 0, unsettled: 0 });
    },
    scaled(60_000),
  );
});

describe('a lease that lapses with units not handed out', () => {
  it(
    'takes them out of unsettled when it closes: no event will come for them',
    async () => {
      const { redis, key, gw, subject } = await leasedGateway();
      const once = async () => {
        const res = await gw.call('/v1/pets', key.key);
        await res.arrayBuffer();
        expect(res.status).toBe(200);
      };
      await once(); // a lease of 2: one unit handed out, one left
      await nextMinute(redis.url); // the lease lapses with its minute, its unit never handed out
      await once(); // closes it (its unit back) and takes the next lease, one unit of it handed out
      await eventually(async () => (await gw.gateway.store.exportState!(subject)).exported === 2, 20_000, 'both events exported');
      const { dayUsed } = await gw.gateway.store.peek(subject);
      // The day: 2 requests + the second lease's unit not handed out; unsettled: that unit alone.
      expect({ dayUsed, state: await gw.gateway.store.exportState!(subject) }).toEqual({
        dayUsed: 3,
        state: { exported: 2, pending: 0, dropped: 0, rejected: 0, unsettled: 1 },
      });
    },
    scaled(120_000),
  ); // up to a minute for the next one
});

describe('a leased admission that fails after its event was written', () => {
  it('keeps its unit counted: the event goes out with status null and no refund, so day = events net of refunds + unsettled', {
    timeout: scaled(60_000),
  }, async () => {
    // The store and the exporter as the wiring builds them (app.ts), on a real Redis, to the
    // test's CloudEvents sink, at the shipped settings, but with the store's clock injected: an
    // event waits for its status (event-batches.ts, statusWait) 62 s, and to outlive it a
    // request would be kept open for a minute. So the store's
    // monotonic clock is moved on past the wait instead; its wall clock is untouched.
    const shipped = loadSettings({});
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const key = makeKey('leased');
    const config = compileConfig(
      validateConfigFile(testConfig([key], { plans, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 100 } } }), 'test'),
      uniquePrefix(),
    );
    const subject = [...config.consumers.values()].find((c) => c.id === key.id)!.subject;
    const conn = testClient(redis.url);
    onTestFinished(() => conn.disconnect());
    const warnings: string[] = [];
    const log = { info: () => {}, error: () => {}, debug: () => {}, warn: (_: object, msg: string) => warnings.push(msg) };
    let movedOnMs = 0;
    const clock = { wall: Date.now, mono: () => performance.now() + movedOnMs };
    const store = new RedisQuotaStore(conn, log as unknown as FastifyBaseLogger, {
      leaseMax: shipped.quotaLeaseMax,
      usageBatchMs: shipped.usageBatchMs,
      upstreamTimeoutMs: shipped.upstreamTimeoutMs,
      requestTimeoutMs: shipped.requestTimeoutMs,
      clock,
      marks: activityMarks(conn, () => config),
    });
    onTestFinished(() => store.close());
    const exporting = testClient(redis.url);
    const exporter = new UsageExporter({
      redis: exporting,
      config: () => config,
      log: log as unknown as FastifyBaseLogger,
      metrics: {
        exported: () => {},
        failed: () => {},
        dropped: () => {},
        rejected: () => {},
        duplicates: () => {},
        lag: () => {},
        round: () => {},
      },
      sink: (target) => new HttpCloudEventsSink(target.url),
    });
    onTestFinished(async () => {
      exporter.stop();
      await exporting.quit();
    });
    exporter.start();
    await roomInTheMinute(redis.url);

    // Two admissions from one lease of 2: the first's request goes on, the second's ends with a 200.
    const tag = (rid: string): EventTag => ({ requestId: rid, keyId: key.id, plan: 'leased', route: 'listPets', method: 'GET' });
    const [slowTag, quickTag] = [tag('slow'), tag('quick')];
    const slow = await store.consume(subject, 1, slowTag);
    const quick = await store.consume(subject, 1, quickTag);
    // Each request's event id comes back on its tag (the lease's decision is shared by its units).
    expect([slow, quick].map((d, i) => [d.outcome, EventBatches.isLeased([slowTag, quickTag][i]!.eventId ?? '')])).toEqual([
      ['allowed', true],
      ['allowed', true],
    ]);
    store.recordStatus(subject, quickTag.eventId!, 200);
    movedOnMs = statusWait(shipped); // the slow request has outlived the status wait
    const at = () => new Map(sink.requests().map((e) => [e.data!.requestId, e.data!.status]));
    await eventually(() => at().size === 2, 20_000, 'both events at the sink');
    expect(at()).toEqual(
      new Map<unknown, unknown>([
        ['quick', 200],
        ['slow', null],
      ]),
    );

    // Its backend fails now (502): the refund the gateway asks for finds its event gone.
    await store.refund(subject, slow.nowMs, 1, slowTag.eventId);
    store.recordStatus(subject, slowTag.eventId!, 502);
    await store.close(); // every event and refund still in memory written
    await eventually(async () => (await store.exportState(subject)).pending === 0, 20_000, 'the stream sent');
    const refunds = [...sink.events.values()].filter((e) => e.type === 'com.petstore.gateway.request.refunded');
    const { dayUsed } = await store.peek(subject);
    expect({ dayUsed, refunds: refunds.length, state: await store.exportState(subject), failed: store.counts.refundsFailed }).toEqual({
      dayUsed: 2,
      refunds: 0,
      state: { exported: 2, pending: 0, dropped: 0, rejected: 0, unsettled: 0 },
      failed: 1,
    });
    expect(warnings).toContain('quota store: a refund came after its usage event was written; the request stays counted');
    const { unsettled } = await store.exportState(subject);
    expect(dayUsed).toBe(sink.requests().length - refunds.length + unsettled);
  });
});

/** Waits for the next minute on Redis's clock (the event a lease lapses on). */
async function nextMinute(url: string) {
  const redis = testClient(url);
  const [s, us] = await redis.time();
  redis.disconnect();
  await sleep(60_000 - ((Number(s) * 1000 + Math.floor(Number(us) / 1000)) % 60_000) + 50);
}
