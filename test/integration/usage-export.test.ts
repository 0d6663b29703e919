import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, tempDir, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildInstances, buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { freePort } from '../helpers/net.js';
import { type Started, startProcess } from '../helpers/processes.js';
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
  });

  it('past the cap, drops the oldest events and counts each: what the sink got and the count add up to what was counted', async () => {
    const over = makeKey('metered');
    // One deployment: the first instance compiles the config (its Redis prefix), the others take it as it is.
    gateways[0]!.load(testConfig([key, over], { plans, usage: exportTo(sink.url) }));
    for (const g of gateways.slice(1)) g.gateway.setConfig(gateways[0]!.gateway.config());
    const before = sink.requests().length;
    sink.state.mode = 'down';
    const answers = await traffic([gateways[0]!.url], over.key, 1300); // the cap is 1,000 (approximately: Redis trims whole nodes)
    sink.state.mode = 'up';
    const name = [...gateways[0]!.gateway.config().consumers.values()].find((c) => c.id === over.id)!.subject.name;
    await eventually(async () => (await gateways[0]!.redis!.xlen(`${name}:events`)) === 0, 40_000, 'the stream sent');
    const delivered = sink.requests().filter((e) => e.subject === over.id).length;
    const dropped = await metricSum(gateways, 'gateway_usage_events_dropped_total');
    expect(answers.every((a) => a.status === 200 || a.status === 404)).toBe(true);
    expect(dropped).toBeGreaterThan(0);
    expect(delivered + dropped).toBe(1300);
    expect(sink.requests().length - before).toBe(delivered);
    // The admin lookup reconciles the same: every event written is exported, pending or dropped.
    const usage = await (
      await fetch(`${gateways[1]!.adminUrl}/admin/accounts/${over.id}/usage`, { headers: { authorization: `Bearer ${TOKEN}` } })
    ).json();
    expect(usage.events).toEqual({ exported: delivered, pending: 0, dropped });
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
    expect(refund.data).toEqual({ refundOf: request!.id, units: -1 });
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
  });
});
