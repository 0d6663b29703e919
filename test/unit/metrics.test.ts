import { describe, expect, it } from 'vitest';
import { AggregatorRegistry, Counter, Histogram, type Metric, Registry } from 'prom-client';
import { GatewayMetrics, TallyHistogram } from '../../gateway/observability/metrics.js';

const store = { degraded: false, activeBans: () => 2 };

describe('metrics labels', () => {
  it('carry no key id unless configured', async () => {
    const m = new GatewayMetrics(false);
    m.watch(store);
    m.request('listPets', 200, 'free', 'acme');
    const text = await m.registry.metrics();
    expect(text).toContain('gateway_requests_total{route="listPets",status="200",plan="free"} 1');
    expect(text).not.toContain('acme');
    expect(text).toMatch(/^gateway_bans_active 2$/m);
  });

  it('carry the key id when METRICS_KEY_IDS is on', async () => {
    const m = new GatewayMetrics(true);
    m.watch(store);
    m.request('listPets', 429, 'free', 'acme', 'minute');
    const text = await m.registry.metrics();
    expect(text).toContain('gateway_requests_total{route="listPets",status="429",plan="free",key="acme"} 1');
    expect(text).toContain('gateway_rejections_total{reason="minute"} 1');
  });

  it('count each series apart, as prom-client would for the same requests', async () => {
    const requests: Array<[string, number, string, string | undefined, 'minute' | 'unauthenticated' | undefined]> = [
      ['listPets', 200, 'free', 'a', undefined],
      ['listPets', 200, 'pro', 'b', undefined],
      ['listPets', 429, 'free', 'a', 'minute'],
      ['getPet', 200, 'free', 'a', undefined],
      ['none', 401, 'none', undefined, 'unauthenticated'],
      ['listPets', 200, 'free', 'c', undefined],
      ['listPets', 200, 'pro', 'b', undefined],
      ['listPets', 429, 'free', 'a', 'minute'],
      ['listPets', 200, 'free', 'a', undefined],
    ];
    for (const keyLabels of [false, true]) {
      const m = new GatewayMetrics(keyLabels);
      const reference = new Registry();
      const total = new Counter({
        name: 'gateway_requests_total',
        help: 'h',
        labelNames: keyLabels ? ['route', 'status', 'plan', 'key'] : ['route', 'status', 'plan'],
        registers: [reference],
      });
      const refused = new Counter({ name: 'gateway_rejections_total', help: 'h', labelNames: ['reason'], registers: [reference] });
      for (const [route, status, plan, key, rejected] of requests) {
        m.request(route, status, plan, key, rejected);
        total.inc(keyLabels ? { route, status, plan, key: key ?? 'none' } : { route, status, plan });
        if (rejected) refused.inc({ reason: rejected });
      }
      const series = async (r: Registry, name: string) =>
        ((await r.getSingleMetric(name)!.get()).values as Array<{ labels: object; value: number }>)
          .map((v) => JSON.stringify([v.labels, v.value]))
          .sort();
      for (const name of ['gateway_requests_total', 'gateway_rejections_total']) {
        expect(await series(m.registry, name)).toEqual(await series(reference, name));
      }
    }
  });
});

describe('the tallied histogram', () => {
  const buckets = [0.001, 0.01, 0.1, 1];
  const observations: Array<[string, number]> = [
    ['a', 0.0005],
    ['a', 0.001],
    ['a', 0.05],
    ['b', 3],
    ['a', 0.5],
    ['b', 0.002],
  ];
  const both = () => {
    const ours = new Registry();
    const tally = new TallyHistogram('h_seconds', 'help', 'route', buckets);
    ours.registerMetric(tally as unknown as Metric);
    const theirs = new Registry();
    const reference = new Histogram({ name: 'h_seconds', help: 'help', labelNames: ['route'], buckets, registers: [theirs] });
    for (const [route, v] of observations) {
      tally.observe(route, v);
      reference.labels(route).observe(v);
    }
    return { ours, theirs };
  };

  it("exposes what prom-client's Histogram exposes for the same observations", async () => {
    const { ours, theirs } = both();
    const text = await ours.metrics();
    expect(text).toBe(await theirs.metrics());
    expect(text).toMatch(/^h_seconds_bucket\{le="0.1",route="a"\} 3$/m);
    expect(text).toMatch(/^h_seconds_count\{route="b"\} 2$/m);
  });

  it('adds up across workers like a Histogram in the AggregatorRegistry', async () => {
    const { ours, theirs } = both();
    const sum = async (r: Registry) => AggregatorRegistry.aggregate([await r.getMetricsAsJSON(), await r.getMetricsAsJSON()]).metrics();
    expect(await sum(ours)).toBe(await sum(theirs));
  });
});
