import { describe, expect, it } from 'vitest';
import { GatewayMetrics } from '../../gateway/metrics.js';

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
});
