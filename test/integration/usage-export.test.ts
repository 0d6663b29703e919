import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, inject, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { loopKey, subjectKey } from '../../gateway/redis/keys.js';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { addBatchEvent, batchEvents, defineScripts, usageBatchArgs } from '../../gateway/quota/redis/script.js';
import { defineCursorScripts, moveUsageCursor, readUsage } from '../../gateway/usage/cursors.js';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, redisKeyOf, tempDir, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildInstances, buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { freePort, waitForPort } from '../helpers/net.js';
import { spawnOwned, type Started, startProcess } from '../helpers/processes.js';
import { spawnRedis, testClient } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';

// Usage events: written in the same script call that counts the request, exported to a real
// sink as CloudEvents (checked by the cloudevents SDK), at least once with stable ids, by one
// exporter across instances; the sink dedupes by id, so it counts each request exactly once.

const TOKEN = 'admin-token-0123456789';
const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };
const exportTo = (url: string, maxEvents = 1000): ConfigFile['usage'] => ({ export: { url, maxEvents, batchSize: 50 } });

/** `n` requests with `key` over `urls` in turn, one in four to a route that does not exist (a 404, counted all the same). */
async function traffic(urls: string[], key: string, n: number) {
  const answers = [];
  for (let i = 0; i < n; i++) {
    const res = await call(`${urls[i % urls.length]}${i % 4 === 3 ? '/v1/nope' : '/v1/pets'}`, key);
    await res.arrayBuffer();
    answers.push({ id: res.headers.get('x-request-id')!, status: res.status });
  }
  return answers;
}

describe('usage export across three instances', () => {
  let sink: Awaited<ReturnType<typeof startSink>>;
  let gateways: TestGateway[];
  const key = makeKey('metered');
  beforeAll(async () => {
    sink = await startSink();
    ({ instances: gateways } = await buildInstances(3, {
      config: testConfig([key], { plans, usage: exportTo(sink.url) }),
      admin: { token: TOKEN },
    }));
  });
  afterAll(async () => {
    for (const g of gateways) await g.close();
    await sink.close();
  });

  it('delivers one event per counted request, with its final status, each valid CloudEvents 1.0', async () => {
    const answers = await traffic(
      gateways.map((g) => g.url),
      key.key,
      120,
    );
    expect(answers.filter((a) => a.status !== 200 && a.status !== 404)).toEqual([]);
    await eventually(() => sink.requests().length >= 120, 20_000, 'every event at the sink');
    const byRequest = new Map(sink.requests().map((e) => [e.data!.requestId as string, e]));
    expect(sink.requests()).toHaveLength(120);
    expect(sink.state.invalid).toEqual([]);
    // Leased on three instances: each event written once, the units not handed out unsettled.
    const subject = subjectOf(gateways[0]!, key.id);
    await eventually(async () => (await gateways[0]!.gateway.store.exportState!(subject)).pending === 0, 20_000, 'the stream sent');
    expect(await gateways[0]!.gateway.store.exportState!(subject)).toEqual({
      exported: 120,
      pending: 0,
      dropped: 0,
      rejected: 0,
      unsettled: (await dayUsed(gateways[0]!, key.id)) - 120,
    });
    expect(sink.state.duplicates).toBe(0); // one exporter at a time: nothing was sent twice
    for (const a of answers) {
      const e = byRequest.get(a.id)!;
      expect({ id: a.id, status: e?.data?.status }).toEqual({ id: a.id, status: a.status });
      expect(e).toMatchObject({
        specversion: '1.0',
        type: 'com.petstore.gateway.request',
        source: '/pet-store-gateway/production',
        subject: key.id,
      });
      expect(e.data).toMatchObject({
        keyId: key.id,
        plan: 'metered',
        units: 1,
        method: 'GET',
        route: a.status === 200 ? 'listPets' : 'none',
      });
    }
  });

  it('loses nothing within the cap while the sink is down for 10 s', async () => {
    const before = sink.requests().length;
    sink.state.mode = 'down';
    const answers = await traffic(
      gateways.map((g) => g.url),
      key.key,
      60,
    );
    await new Promise((r) => setTimeout(r, 10_000)); // the outage itself
    sink.state.mode = 'up';
    await eventually(() => sink.requests().length >= before + 60, 40_000, 'the backlog delivered');
    const ids = new Set(sink.requests().map((e) => e.data!.requestId));
    expect(answers.filter((a) => !ids.has(a.id))).toEqual([]);
    expect(await metricSum(gateways, 'gateway_usage_export_failures_total')).toBeGreaterThan(0);
  }, 60_000); // the outage, then the backoff, which the leader now sits out holding the lead (up to the lock's 15 s)

  it('past the cap, drops the oldest events and counts each: what the sink got and the count add up to what was counted', async () => {
    const over = makeKey('metered');
    // One deployment: the first instance compiles the config (its Redis prefix), the others take it as it is.
    gateways[0]!.load(testConfig([key, over], { plans, usage: exportTo(sink.url) }));
    for (const g of gateways.slice(1)) g.gateway.setConfig(gateways[0]!.gateway.config());
    const before = sink.requests().length;
    sink.state.mode = 'down';
    const answers = await traffic([gateways[0]!.url], over.key, 1300); // the cap is 1,000 events (the bundles go whole)
    const events = async () =>
      (
        (await (
          await fetch(`${gateways[1]!.adminUrl}/admin/accounts/${over.id}/usage`, { headers: { authorization: `Bearer ${TOKEN}` } })
        ).json()) as { events: { exported: number; pending: number; dropped: number } }
      ).events;
    // The sink stays down until every event is in the stream: a leased admission's event is
    // written with its instance's next batch (USAGE_BATCH_MS), so the stream passes the cap only then.
    await eventually(
      async () => {
        const e = await events();
        return e.exported + e.pending + e.dropped === 1300;
      },
      20_000,
      'every event written',
    );
    sink.state.mode = 'up';
    await eventually(async () => (await events()).pending === 0, 40_000, 'the stream and bundles sent');
    const delivered = sink.requests().filter((e) => e.subject === over.id).length;
    const seen = await metricSum(gateways, 'gateway_usage_events_dropped_total');
    expect(answers.every((a) => a.status === 200 || a.status === 404)).toBe(true);
    expect(sink.requests().length - before).toBe(delivered);
    // The admin lookup reconciles: every event written is exported, pending or dropped, never two of them.
    const usage = await (
      await fetch(`${gateways[1]!.adminUrl}/admin/accounts/${over.id}/usage`, { headers: { authorization: `Bearer ${TOKEN}` } })
    ).json();
    const { dropped } = usage.events;
    expect(dropped).toBeGreaterThan(0);
    expect(delivered + dropped).toBe(1300);
    // Every unit the day counted is in an event written (exported or dropped) or unsettled (a lease's units not handed out).
    expect(usage.events).toEqual({ exported: delivered, pending: 0, dropped, rejected: 0, unsettled: usage.windows.day.used - 1300 });
    // The metric counts each drop as the leader finds it: a bundle the cap dropped after a round read it, then
    // delivered, is in it too (statements.test.ts, "tallies a bundle once"), and exported in the reconcile.
    expect(seen).toBeGreaterThanOrEqual(dropped);
  });
});

/** A counter's value summed over the instances' registries. */
async function metricSum(gateways: TestGateway[], name: string): Promise<number> {
  let sum = 0;
  for (const g of gateways) {
    const text = await g.gateway.metrics.registry.getSingleMetricAsString(name);
    sum += Number(/ (\d+(?:\.\d+)?)$/m.exec(text)?.[1] ?? 0);
  }
  return sum;
}

describe('a refund in the export', () => {
  it("a 502 the gateway gives is exported as a refund that cancels its request's units", async () => {
    const sink = await startSink();
    const key = makeKey('metered');
    const closed = await freePort();
    const gw = await buildTestGateway({
      config: testConfig([key], { plans, usage: exportTo(sink.url) }),
      backend: `http://127.0.0.1:${closed}`,
    });
    const res = await call(`${gw.url}/v1/pets`, key.key);
    expect(res.status).toBe(502);
    await eventually(() => sink.events.size >= 2, 20_000, 'the request and its refund');
    const [request] = sink.requests();
    const refund = [...sink.events.values()].find((e) => e.type === 'com.petstore.gateway.request.refunded')!;
    expect(request!.data).toMatchObject({ requestId: res.headers.get('x-request-id'), units: 1, status: 502 });
    // Its statement line with it (refund.lua's): a biller grouping by route nets it in the request's.
    expect(refund.data).toEqual({ refundOf: request!.id, units: -1, plan: 'metered', route: 'listPets' });
    expect(refund.subject).toBe(key.id);
    await sink.close();
  });
});

describe('usage export when the exporting gateway is killed mid-batch', () => {
  let sink: Awaited<ReturnType<typeof startSink>>;
  const procs: Started[] = [];
  const dir = tempDir();
  afterAll(async () => {
    for (const p of procs) await p.stop();
    await sink?.close();
    dir.cleanup();
  });

  it('the next leader sends the batch again: the sink, deduping by id, has every request exactly once', async () => {
    sink = await startSink();
    const echo = await echoBackend();
    const key = makeKey('metered');
    const file = join(dir.dir, 'gateway.json');
    writeFileSync(file, JSON.stringify(testConfig([key], { plans, usage: exportTo(sink.url) })));
    const env = {
      REDIS_URL: inject('redisUrl'),
      GATEWAY_CONFIG: file,
      BACKEND_URL: echo.url,
      REDIS_KEY_PREFIX: uniquePrefix(),
      GATEWAY_PORT: '0',
      ADMIN_PORT: '0',
    };
    for (let i = 0; i < 3; i++) procs.push(await startProcess('dist/gateway/server.js', env, (l) => l.msg === 'gateway ready'));
    const urls = procs.map((p) => String(p.logs.find((l) => l.msg === 'gateway ready')!.address));
    sink.state.mode = 'hold'; // the first batch is taken and kept unanswered
    const answers = await traffic(urls, key.key, 40);
    await eventually(() => sink.held.length > 0, 20_000, 'a batch held at the sink');
    // Leased admissions' events reach the stream in their instance's batches (within USAGE_BATCH_MS):
    // all of them written before the kill, so what this test loses is only the exporter's batch.
    const redis = testClient(inject('redisUrl'));
    onTestFinished(() => void redis.quit());
    // The events the account's bundles took (usagebatch.lua's `badded`): none was sent yet.
    const cursor = `${env.REDIS_KEY_PREFIX}:production:{k:${key.id}}:events:cursor`;
    await eventually(async () => (await redis.hget(cursor, 'badded')) === '40', 20_000, 'every event in the bundles');
    const leader = procs.find((p) => p.logs.some((l) => l.msg === 'usage-export: this instance leads'))!;
    leader.proc.kill('SIGKILL');
    await new Promise((r) => leader.proc.once('exit', r));
    sink.state.mode = 'up';
    sink.release(); // the sink keeps that batch; its exporter never learns it did
    await eventually(
      () => new Set(sink.requests().map((e) => e.data!.requestId)).size >= 40 && sink.state.duplicates > 0,
      30_000,
      'the batch sent again',
    );
    const ids = new Set(sink.requests().map((e) => e.data!.requestId));
    expect(answers.filter((a) => !ids.has(a.id))).toEqual([]);
    expect(sink.requests()).toHaveLength(40);
    expect(sink.state.duplicates).toBeGreaterThan(0); // the scenario happened: a batch arrived twice
    await echo.close();
  }, 60_000); // the dead leader's lock lapses LEASE_MS (15 s) after its last renewal
});

/** The export leader's lock key, as leader.ts names it. */
const exportLock = (gateway: TestGateway) => `${gateway.gateway.config().registryKey.replace(/\{gateways\}$/, '{usage-export}')}:lock`;
/** What the day window counted for the key's account, as the store reads it. */
const dayUsed = async (gateway: TestGateway, id: string) => (await gateway.gateway.store.peek(subjectOf(gateway, id))).dayUsed;
const subjectOf = (gateway: TestGateway, id: string) => [...gateway.gateway.config().consumers.values()].find((c) => c.id === id)!.subject;
const values = (results: Array<[Error | null, unknown]> | null) =>
  (results ?? []).map(([err, value]) => {
    if (err) throw err;
    return value;
  });

describe('the usage exporter', () => {
  it('runs on a thread of its own: a request thread kept busy does not stop the export', async () => {
    // The sink in a process of its own: this test blocks its own thread, where the gateway's runs.
    const sinkPort = await freePort();
    const sinkProc = spawnOwned(
      process.execPath,
      [
        '-e',
        `require('node:http').createServer((q, s) => { q.resume(); q.on('end', () => s.writeHead(200).end()); }).listen(${sinkPort}, '127.0.0.1')`,
      ],
      { stdio: 'ignore' },
    );
    onTestFinished(() => void sinkProc.kill('SIGKILL'));
    await waitForPort(sinkPort, 5000);
    const key = makeKey('metered');
    const gw = await buildTestGateway({ config: testConfig([key], { plans, usage: exportTo(`http://127.0.0.1:${sinkPort}/events`) }) });
    onTestFinished(() => gw.close());
    const config = gw.gateway.config();
    const name = redisKeyOf(config, key.id);
    // Ten events in the account's stream (a leased admission's layout) and the account marked, as a batch leaves them.
    const redis = testClient(inject('redisUrl'));
    onTestFinished(() => void redis.quit());
    const data = JSON.stringify({
      requestId: 'r',
      keyId: key.id,
      plan: 'metered',
      route: 'listPets',
      method: 'GET',
      units: 1,
      status: 200,
    });
    for (let i = 0; i < 10; i++) await redis.xadd(subjectKey.events(name), '*', 'kind', 'request', 'at', String(Date.now()), 'data', data);
    await redis.zincrby(loopKey(config.redisPrefix, 'usage-export', 'active'), 1, name);
    // This thread (the gateway's request thread) blocked from here until the stream is sent, or 20 s.
    const [host, port] = [new URL(inject('redisUrl')).hostname, new URL(inject('redisUrl')).port];
    const pending = () => Number(execFileSync('redis-cli', ['-h', host, '-p', port, 'XLEN', subjectKey.events(name)]).toString());
    const until = Date.now() + 20_000;
    let left = pending();
    while (left > 0 && Date.now() < until) left = pending();
    expect(left).toBe(0);
  });
});

describe('a leading gateway that stops', () => {
  it('gives both leads up before it closes: the next instance leads at its next tick, not once the locks lapse (15 s)', async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const receiver = `http://127.0.0.1:${await freePort()}/hooks`; // never called: no threshold is reached
    const secret = `whsec_${Buffer.from('a secret of thirty-two bytes!!!!').toString('base64')}`;
    const config = testConfig([makeKey('metered')], {
      plans,
      usage: exportTo(sink.url),
      alerts: { url: receiver, secret, thresholds: [0.5] },
    });
    const [gw] = (await buildInstances(1, { config })).instances;
    const redis = testClient(inject('redisUrl'));
    onTestFinished(() => void redis.quit());
    const locks = [exportLock(gw!), exportLock(gw!).replace('{usage-export}', '{alerts}')];
    await eventually(async () => (await redis.exists(...locks)) === 2, 15_000, 'both leads taken');
    await gw!.close();
    // Nothing else runs on these keys: a lock still there would be this instance's, for up to LEASE_MS.
    expect(await redis.exists(...locks)).toBe(0);
  });
});

describe('usage export to a sink slower than an unrenewed lock would last', () => {
  it('keeps one leader: every event once at the sink, one POST in flight at a time, the reconcile exact per account', async () => {
    const sink = await startSink();
    const keys = [makeKey('metered'), makeKey('metered')]; // two accounts, as in the trial that found it
    const { instances } = await buildInstances(3, { config: testConfig(keys, { plans, usage: exportTo(sink.url) }) });
    const redis = instances[0]!.redis!;
    const lock = exportLock(instances[0]!);
    /** The lock's holder, and when it lapses on Redis's clock (in ms). */
    const lockState = async () => {
      const [holder, ttl, [s, us]] = values(await redis.multi().get(lock).pttl(lock).time().exec()) as [string, number, [string, string]];
      return { holder, lapsesAt: Number(s) * 1000 + Number(us) / 1000 + ttl };
    };
    // Each POST is answered only once the lock's lapse, as it stood when the POST arrived, has
    // been pushed back by its holder, which then held it for longer than it would have lasted
    // unrenewed; or once a second POST arrives (a second leader: the old 5 s lock lapsed first).
    let renewedDuringPost = 0;
    sink.state.slow = async () => {
      const arrived = await lockState();
      await eventually(
        async () => {
          if (sink.state.inFlight > 1) return true;
          const now = await lockState();
          if (now.holder !== arrived.holder || now.lapsesAt < arrived.lapsesAt + 1000) return false;
          renewedDuringPost++;
          return true;
        },
        20_000,
        'the lock renewed during the POST, or a second POST',
      );
    };
    for (let i = 0; i < 60; i++) {
      const res = await call(`${instances[i % 3]!.url}/v1/pets`, keys[i % 2]!.key);
      expect(res.status).toBe(200);
      await res.arrayBuffer();
    }
    const states = () => Promise.all(keys.map((k) => instances[0]!.gateway.store.exportState!(subjectOf(instances[0]!, k.id))));
    await eventually(
      async () => sink.requests().length >= 60 && (await states()).every((s) => s.pending === 0),
      50_000,
      'every event at the sink and every stream sent',
    );
    expect(sink.state.problems).toEqual([]);
    expect(sink.state.maxInFlight).toBe(1);
    expect(sink.state.duplicates).toBe(0);
    expect(sink.requests()).toHaveLength(60);
    // The units the day counted and no event holds: the instances' leases' units not handed out.
    const unsettled = (k: (typeof keys)[number]) => dayUsed(instances[0]!, k.id).then((used) => used - 30);
    expect(await states()).toEqual([
      { exported: 30, pending: 0, dropped: 0, rejected: 0, unsettled: await unsettled(keys[0]!) },
      { exported: 30, pending: 0, dropped: 0, rejected: 0, unsettled: await unsettled(keys[1]!) },
    ]);
    expect(renewedDuringPost).toBeGreaterThan(0); // the scenario happened: a POST outlasted the lock's unrenewed life
    await sink.close();
  }, 90_000); // each POST waits for a renewal (a third of the lock's life): a few of them in a row
});

describe('a leader that loses the lock during a round', () => {
  it('aborts its POST, moves nothing and counts no sink failure; the next leader sends it all', async () => {
    const sink = await startSink();
    const key = makeKey('metered');
    const gw = await buildTestGateway({ config: testConfig([key], { plans, usage: exportTo(sink.url) }) });
    const redis = gw.redis!;
    sink.state.mode = 'hold'; // the POST stays in flight
    for (let i = 0; i < 5; i++) await (await gw.call('/v1/pets', key.key)).arrayBuffer();
    await eventually(() => sink.held.length > 0, 20_000, 'a batch held at the sink');
    const failures = await metricSum([gw], 'gateway_usage_export_failures_total');
    const lock = exportLock(gw);
    await redis.set(lock, 'another-instance:1', 'PX', 60_000); // another instance took the lock
    await gw.waitForLog((l) => l.msg === 'usage-export: this instance lost the lead', 15_000);
    await eventually(() => sink.state.inFlight === 0, 5000, 'the POST abandoned by the gateway');
    const subject = subjectOf(gw, key.id);
    // Units of the lease not handed out are unsettled: what this test is about is the stream's.
    expect(await gw.gateway.store.exportState!(subject)).toMatchObject({ exported: 0, pending: 5, dropped: 0 });
    sink.state.mode = 'up';
    await redis.del(lock); // the other instance is gone: this one takes the lead again
    await eventually(() => sink.requests().length >= 5, 20_000, 'the batch sent by the next lead');
    await eventually(async () => (await gw.gateway.store.exportState!(subject)).pending === 0, 5000, 'the stream sent');
    expect(await gw.gateway.store.exportState!(subject)).toMatchObject({ exported: 5, pending: 0, dropped: 0 });
    expect(await metricSum([gw], 'gateway_usage_export_failures_total')).toBe(failures);
    await sink.close();
  }, 40_000); // a renewal comes a third of the lock's life into the round
});

describe('a Redis that freezes during a round', () => {
  it('is blamed in the log, not the sink, and counts no sink failure; the export resumes after it', async () => {
    const redis = await spawnRedis(); // its own Redis, so this test can freeze it
    onTestFinished(() => redis.stop());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const key = makeKey('metered');
    const gw = await buildTestGateway({ config: testConfig([key], { plans, usage: exportTo(sink.url) }), redis: redis.url });
    sink.state.mode = 'hold'; // a round in flight when Redis freezes
    for (let i = 0; i < 3; i++) await (await gw.call('/v1/pets', key.key)).arrayBuffer();
    await eventually(() => sink.held.length > 0, 20_000, 'a batch held at the sink');
    redis.proc.kill('SIGSTOP');
    const blamed = await gw.waitForLog(
      (l) => /^usage-export: (this instance lost the lead|a round failed on Redis)$/.test(String(l.msg)),
      30_000,
    );
    expect(String(blamed.cause)).toContain(`Redis at 127.0.0.1:${new URL(redis.url).port}`);
    redis.proc.kill('SIGCONT');
    sink.state.mode = 'up';
    await eventually(() => sink.requests().length >= 3, 30_000, 'the events sent once Redis is back');
    expect(await metricSum([gw], 'gateway_usage_export_failures_total')).toBe(0);
    expect(gw.logs.filter((l) => l.msg === 'usage export: a batch failed')).toEqual([]);
  }, 60_000); // the frozen call gives up after the client's command timeout, a renewal a third of the lock's life into the round
});

describe("a stale leader's cursor move", () => {
  it('is refused for an older fencing token or an older cursor, and counts nothing twice', async () => {
    const redis = testClient(inject('redisUrl'));
    defineCursorScripts(redis);
    const name = `${uniquePrefix()}:{k:acct}`;
    const ids: string[] = [];
    for (let i = 0; i < 4; i++) ids.push((await redis.xadd(`${name}:events`, '*', 'kind', 'request', 'at', String(Date.now())))!);
    await redis.hset(`${name}:statuses`, Object.fromEntries(ids.map((id) => [id, '200'])));
    const state = async () => {
      const [cursor, length, statuses] = values(
        await redis.multi().hgetall(`${name}:events:cursor`).xlen(`${name}:events`).hlen(`${name}:statuses`).exec(),
      ) as [Record<string, string>, number, number];
      return { cursor: cursor.id, consumed: Number(cursor.consumed), pending: length, statuses };
    };
    const [a, b, c, d] = ids as [string, string, string, string];
    const first = { from: '0-0', to: b, consumed: 2, refs: [a, b] };
    expect(await moveUsageCursor(redis, name, { token: 10, ...first })).toBe('moved');
    expect(await state()).toEqual({ cursor: b, consumed: 2, pending: 2, statuses: 2 });
    // A leader that took the lead before token 10's: refused, whatever it moves.
    expect(await moveUsageCursor(redis, name, { token: 9, from: b, to: d, consumed: 2, refs: [c, d] })).toBe('fenced');
    // The same lead moving a batch it read before its own move (or a rival with an equal token): refused.
    expect(await moveUsageCursor(redis, name, { token: 10, ...first })).toBe('raced');
    expect(await state()).toEqual({ cursor: b, consumed: 2, pending: 2, statuses: 2 });
    expect(await moveUsageCursor(redis, name, { token: 11, from: b, to: d, consumed: 2, refs: [c, d] })).toBe('moved');
    // Token 10 is now stale, even with the right cursor.
    expect(await moveUsageCursor(redis, name, { token: 10, from: d, to: d, consumed: 0, refs: [] })).toBe('fenced');
    expect(await state()).toEqual({ cursor: d, consumed: 4, pending: 0, statuses: 0 });
    await redis.quit();
  });
});

describe("the bundles' cap and the exporter's move", () => {
  it('count a bundle the cap dropped after the leader read it once, as dropped: sent + pending + dropped = written', async () => {
    const redis = testClient(inject('redisUrl'));
    onTestFinished(() => void redis.quit());
    defineCursorScripts(redis);
    defineScripts(redis);
    const run = redis as unknown as Record<'usagebatch', (...args: Array<string | number>) => Promise<number>>;
    // A cap of 10 events, set on the subject the script is given (the config's least is 1,000): three bundles of four overflow it.
    const s: QuotaSubject = {
      name: `${uniquePrefix()}:{k:acct}`,
      limits: { perMinute: 1000, perDay: 10_000 },
      bans: null,
      policy: '',
      lasting: true,
      billing: NO_BILLING,
      events: 10,
      alerts: '',
      enforce: true,
    };
    let batch = 0;
    const head = { keyId: 'k', plan: 'p', route: 'listPets', method: 'GET' };
    const write = () => {
      const b = batchEvents();
      for (let i = 0; i < 4; i++)
        addBatchEvent(b, { at: Date.now(), tag: { requestId: `r${i}`, ...head }, status: 200, windows: '1,null,1,null' }, 0, '');
      return run.usagebatch(...usageBatchArgs(s, `i:${++batch}`, b));
    };
    const state = async () => {
      const [c, length] = values(await redis.multi().hgetall(subjectKey.eventsCursor(s.name)).xlen(subjectKey.bundles(s.name)).exec()) as [
        Record<string, string>,
        number,
      ];
      return {
        written: Number(c.badded),
        sent: Number(c.bconsumed ?? 0),
        dropped: Number(c.bdropped ?? 0),
        held: Number(c.badded) - Number(c.bupto ?? 0),
        bundles: length,
      };
    };
    await write();
    await write();
    const read = await readUsage(redis, s.name, { count: 0, bundleEvents: 100 });
    expect(read.bundles.map((b) => b.events)).toEqual([4, 4]);
    // A third bundle: 12 events past a cap of 10, so the oldest goes, the one the leader is sending.
    await write();
    expect(await state()).toEqual({ written: 12, sent: 0, dropped: 4, held: 8, bundles: 2 });
    const move = { token: 1, from: read.cursor, consumed: 0, refs: [], bundle: read.bundles[1]! };
    expect(await moveUsageCursor(redis, s.name, move)).toBe('moved');
    // The second bundle counts as sent; the first stays dropped, not sent as well.
    expect(await state()).toEqual({ written: 12, sent: 4, dropped: 4, held: 4, bundles: 1 });
    // The same move again (a stale round of the same lead) counts nothing twice; an older lead's is refused.
    expect(await moveUsageCursor(redis, s.name, move)).toBe('moved');
    expect(await moveUsageCursor(redis, s.name, { ...move, token: 0 })).toBe('fenced');
    expect(await state()).toEqual({ written: 12, sent: 4, dropped: 4, held: 4, bundles: 1 });
  });
});

describe('usage export and alerts at start-up', () => {
  const procs: Started[] = [];
  const dir = tempDir();
  let redis: Awaited<ReturnType<typeof spawnRedis>> | undefined;
  afterAll(async () => {
    for (const p of procs) await p.stop();
    redis?.stop();
    dir.cleanup();
  });

  it('run no round before Redis is connected: no failure logged or counted against the sink or the receiver', async () => {
    const sink = await startSink();
    const echo = await echoBackend();
    const key = makeKey('metered');
    const file = join(dir.dir, 'gateway.json');
    const receiver = `http://127.0.0.1:${await freePort()}/hooks`; // never called: no threshold is reached
    const secret = `whsec_${Buffer.from('a secret of thirty-two bytes!!!!').toString('base64')}`;
    writeFileSync(
      file,
      JSON.stringify(testConfig([key], { plans, usage: exportTo(sink.url), alerts: { url: receiver, secret, thresholds: [0.5] } })),
    );
    const redisPort = await freePort(); // nothing listens there until the gateway is up
    const env = {
      REDIS_URL: `redis://127.0.0.1:${redisPort}`,
      GATEWAY_CONFIG: file,
      BACKEND_URL: echo.url,
      REDIS_KEY_PREFIX: uniquePrefix(),
      GATEWAY_PORT: '0',
      ADMIN_PORT: '0',
    };
    const gw = await startProcess('dist/gateway/server.js', env, (l) => l.msg === 'gateway ready');
    procs.push(gw);
    const ready = gw.logs.find((l) => l.msg === 'gateway ready')!;
    redis = await spawnRedis({ at: redisPort });
    await gw.waitForLog((l) => l.msg === 'usage-export: this instance leads', 15_000);
    await gw.waitForLog((l) => l.msg === 'alerts: this instance leads', 15_000);
    await eventually(async () => (await call(`${ready.address}/v1/pets`, key.key)).status === 200, 10_000, 'a request admitted by Redis');
    await eventually(() => sink.requests().length >= 1, 20_000, 'its event at the sink');
    const failures = /a batch failed|a webhook failed|a round failed/;
    expect(gw.logs.filter((l) => failures.test(String(l.msg))).map((l) => l.msg)).toEqual([]);
    const metrics = await (await fetch(`${ready.admin}/metrics`)).text();
    expect(metrics).toMatch(/^gateway_usage_export_failures_total 0$/m);
    expect(metrics).toMatch(/^gateway_webhook_failures_total 0$/m);
    await sink.close();
    await echo.close();
  }, 40_000);
});
