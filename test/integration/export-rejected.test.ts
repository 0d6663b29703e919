import { createServer } from 'node:http';

import { text } from 'node:stream/consumers';
import { type CloudEvent, HTTP } from 'cloudevents';
import { Redis } from 'ioredis';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { subjectKey } from '../../gateway/redis/keys.js';
import { call, makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { eventually } from '../helpers/time.js';
import { listening } from '../helpers/net.js';

// A biller refuses a whole batch for one event it will never take (Stripe: an unknown customer,
// or an event past its 35 days; Lago: a 422 for the batch), and answers a redelivered event with
// a conflict. The exporter splits a refused batch down to that event and sets it aside (its
// account's `events:rejected`, counted in the reconcile as `rejected`), so the events behind it
// go on; a 409 for one event means the biller has it (issue 49, item 2).

const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };

/**
 * A biller's rules on a real HTTP server, parsed by the cloudevents SDK: a batch with an event of
 * an `unknown` customer is refused 400, whole; a batch with an event it already holds, 409,
 * whole; `failAfterKeeping` keeps the next batch and answers it 503, as a biller that timed out
 * after storing does.
 */
async function biller(unknown: string) {
  const kept = new Map<string, CloudEvent<Record<string, unknown>>>();
  const state = { posts: 0, refused: 0, conflicts: 0, failAfterKeeping: 0 };
  const server = createServer(async (req, res) => {
    const body = await text(req);
    const parsed = HTTP.toEvent({ headers: req.headers as Record<string, string>, body });
    const list = (Array.isArray(parsed) ? parsed : [parsed]) as CloudEvent<Record<string, unknown>>[];
    state.posts++;
    if (list.some((e) => e.subject === unknown)) {
      state.refused++;
      return void res.writeHead(400, { 'content-type': 'application/json' }).end('{"error":"No such customer"}');
    }
    if (list.some((e) => kept.has(e.id))) {
      state.conflicts++;
      return void res.writeHead(409).end();
    }
    for (const e of list) kept.set(e.id, e);
    if (state.failAfterKeeping > 0) {
      state.failAfterKeeping--;
      return void res.writeHead(503).end();
    }
    res.writeHead(200).end();
  });
  const base = await listening(server);
  return { url: `${base}/events`, kept, state };
}

const nameOf = (gw: TestGateway, id: string) => [...gw.gateway.config().consumers.values()].find((c) => c.id === id)!.subject;
const metric = async (gw: TestGateway, name: string) =>
  Number(/ (\d+)$/m.exec(await gw.gateway.metrics.registry.getSingleMetricAsString(name))?.[1] ?? Number.NaN);

describe('a biller that refuses one event for good', () => {
  it('gets every other event; the refused ones are set aside with the reason and reconciled as rejected', async () => {
    const [shop, ghost] = [makeKey('metered'), makeKey('metered')];
    const sink = await biller(ghost.id);
    const gw = await buildTestGateway({
      config: testConfig([shop, ghost], { plans, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } } }),
    });
    onTestFinished(() => gw.close());
    for (let i = 0; i < 40; i++) {
      const res = await call(`${gw.url}/v1/pets`, i % 10 === 3 ? ghost.key : shop.key);
      expect(res.status).toBe(200);
      await res.arrayBuffer();
    }
    const shopEvents = () => [...sink.kept.values()].filter((e) => e.subject === shop.id).length;
    await eventually(() => shopEvents() === 36, 20_000, "every one of shop's 36 events at the biller");
    const [shopName, ghostName] = [nameOf(gw, shop.id), nameOf(gw, ghost.id)];
    await eventually(
      async () => {
        const s = await gw.gateway.store.exportState!(ghostName);
        return s.pending === 0 && s.exported + s.rejected === 4;
      },
      20_000,
      "ghost's four events out of the way",
    );
    const settled = async (s: typeof shopName) => {
      const state = await gw.gateway.store.exportState!(s);
      // Leased units not yet written as events: the figure the reconcile adds; every request here was answered.
      return { ...state, unsettled: undefined, total: state.exported + state.rejected + state.unsettled };
    };
    expect(await settled(shopName)).toEqual({
      exported: 36,
      pending: 0,
      dropped: 0,
      rejected: 0,
      unsettled: undefined,
      total: expect.any(Number),
    });
    expect(await settled(ghostName)).toMatchObject({ exported: 0, pending: 0, dropped: 0, rejected: 4 });
    expect([...sink.kept.values()].filter((e) => e.subject === ghost.id)).toEqual([]);
    const redis = new Redis(inject('redisUrl'));
    onTestFinished(() => redis.quit().then(() => undefined));
    const aside = await redis.hgetall(subjectKey.eventsRejected(ghostName.name));
    expect(Object.keys(aside)).toHaveLength(4);
    for (const [id, value] of Object.entries(aside)) {
      const entry = JSON.parse(value) as { reason: string; event: { id: string; subject: string } };
      expect(entry).toMatchObject({ reason: 'the sink answered 400', event: { id, subject: ghost.id } });
    }
    expect(await metric(gw, 'gateway_usage_events_rejected_total')).toBe(4);
    expect(gw.logs.filter((l) => /refused an event for good/.test(String(l.msg)))).toHaveLength(4);
  });
});

describe('a biller that answers a redelivered batch 409', () => {
  it('counts the events it holds as delivered: none rejected, every one exported once', async () => {
    const key = makeKey('metered');
    const sink = await biller('nobody');
    // The first batch is kept, then answered 503: the exporter sends it again, and the biller says 409.
    sink.state.failAfterKeeping = 1;
    const gw = await buildTestGateway({
      config: testConfig([key], { plans, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } } }),
    });
    onTestFinished(() => gw.close());
    for (let i = 0; i < 10; i++) await (await call(`${gw.url}/v1/pets`, key.key)).arrayBuffer();
    const subject = nameOf(gw, key.id);
    // Written (leased admissions' events come in their batch) and moved past: exported or rejected, all ten.
    await eventually(
      async () => {
        const s = await gw.gateway.store.exportState!(subject);
        return s.pending === 0 && s.exported + s.rejected === 10;
      },
      20_000,
      'every event out',
    );
    expect(sink.state.conflicts).toBeGreaterThan(0);
    expect(await gw.gateway.store.exportState!(subject)).toMatchObject({ exported: 10, pending: 0, rejected: 0 });
    expect(sink.kept.size).toBe(10);
  });
});
