import { describe, expect, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { call, makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';
import { halfBroken } from '../helpers/backends.js';

// OpenMeter meters one exact event type (a meter's `eventType`) and dedupes on (source, id); its
// SUM meter over `$.units` is what the docs' OpenMeter section tells a provider to define. With
// `format: openmeter` a refund is an event of the request's type with negative units, so that one
// meter gives the units delivered; with a type of its own, the meter would bill each refunded
// request (issue 49, item 4). The sink (cloudevents SDK, dedupe by id, one source) keeps those rules.

const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };
const REQUEST_TYPE = 'com.petstore.gateway.request';

describe('usage export in the openmeter format', () => {
  it("nets each refund in the request type's SUM meter: the meter equals the units delivered", async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const key = makeKey('metered');
    const gw = await buildTestGateway({
      config: testConfig([key], { plans, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 100, format: 'openmeter' } } }),
      backend: await halfBroken(),
    });
    onTestFinished(() => gw.close());
    const statuses: number[] = [];
    // One at a time: the backend's every-other drop then falls on every other request.
    for (let i = 0; i < 40; i++) {
      const res = await call(`${gw.url}/v1/pets`, key.key, { headers: { connection: 'close' } });
      await res.arrayBuffer();
      statuses.push(res.status);
    }
    const delivered = statuses.filter((s) => s === 200).length;
    const refunded = statuses.filter((s) => s === 502).length;
    expect(delivered + refunded).toBe(40);
    expect(refunded).toBeGreaterThan(0);
    // Every request's event and every refund's, each once.
    await eventually(() => sink.events.size >= 40 + refunded, 20_000, 'the requests and their refunds at the sink');
    const events = [...sink.events.values()];
    expect(new Set(events.map((e) => e.type))).toEqual(new Set([REQUEST_TYPE]));
    const meter = events.filter((e) => e.type === REQUEST_TYPE).reduce((sum, e) => sum + Number(e.data!.units), 0);
    expect(meter).toBe(delivered);
    // A refund still says which request it takes back.
    const refunds = events.filter((e) => Number(e.data!.units) < 0);
    expect(refunds).toHaveLength(refunded);
    for (const r of refunds) expect(sink.events.get(r.data!.refundOf as string)?.data?.status).toBe(502);
  });
});
