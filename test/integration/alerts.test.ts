import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { Webhook } from 'standardwebhooks';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { defineCursorScripts, moveAlertsCursor } from '../../gateway/usage/cursors.js';
import { call, makeKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildInstances, type TestGateway } from '../helpers/gateway.js';
import { eventually } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

// Threshold alerts: each crossing fires once per account, window, period and threshold across
// instances racing, a top-up that lifts the balance back resolves it, and every webhook is
// signed per Standard Webhooks (verified with the `standardwebhooks` package, not our code).

const TOKEN = 'admin-token-0123456789';
const SECRET = `whsec_${Buffer.from('a secret of thirty-two bytes!!!!').toString('base64')}`;

interface Received {
  id: string;
  body: string;
  headers: Record<string, string>;
}

/** A webhook receiver: a real HTTP server that keeps what it gets and answers 204. */
async function receiver() {
  const got: Received[] = [];
  const server = createServer((req, res) => {
    let body = '';
    req.on('data', (c: Buffer) => (body += c));
    req.on('end', () => {
      got.push({ id: String(req.headers['webhook-id']), body, headers: req.headers as Record<string, string> });
      res.writeHead(204).end();
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/hooks`, got, close: () => new Promise((r) => server.close(r)) };
}

const plans: ConfigFile['plans'] = {
  daily: { perMinute: 100_000, perDay: 100 },
  prepaid: { perMinute: 100_000, perDay: 100_000, credits: { grant: 10, every: 'month' }, alerts: { thresholds: [0.8] } },
};

describe('threshold alerts across three instances', () => {
  let hooks: Awaited<ReturnType<typeof receiver>>;
  let gateways: TestGateway[];
  const daily = makeKey('daily');
  const prepaid = makeKey('prepaid');
  beforeAll(async () => {
    hooks = await receiver();
    const config = testConfig([daily, prepaid], { plans, alerts: { url: hooks.url, secret: SECRET, thresholds: [0.5, 1] } });
    ({ instances: gateways } = await buildInstances(3, { config, admin: { token: TOKEN } }));
  });
  afterAll(async () => {
    for (const g of gateways) await g.close();
    await hooks.close();
  });
  const of = (account: string) => hooks.got.map((h) => JSON.parse(h.body)).filter((b) => b.data.account === account);

  it('fires each crossing once, signed, however the instances race', async () => {
    let next = 0;
    const worker = async () => {
      while (next < 150) {
        const i = next++;
        await (await call(`${gateways[i % 3]!.url}/v1/pets`, daily.key)).arrayBuffer();
      }
    };
    await Promise.all(Array.from({ length: 50 }, worker));
    await eventually(() => of(daily.id).length >= 2, 20_000, 'both crossings delivered');
    const name = [...gateways[0]!.gateway.config().consumers.values()].find((c) => c.id === daily.id)!.subject.name;
    expect(await gateways[0]!.redis!.xlen(`${name}:alerts`)).toBe(2); // written once each, whoever admitted the crossing request
    expect(of(daily.id).map((b) => [b.type, b.data.window, b.data.threshold, b.data.used, b.data.limit])).toEqual([
      ['quota.threshold.crossed', 'day', 0.5, 50, 100],
      ['quota.threshold.crossed', 'day', 1, 100, 100],
    ]);
    const verifier = new Webhook(SECRET);
    for (const h of hooks.got) expect(verifier.verify(h.body, h.headers)).toEqual(JSON.parse(h.body));
    // Another secret does not verify them.
    const other = new Webhook(`whsec_${Buffer.from('another secret of thirty-two b!!').toString('base64')}`);
    expect(() => other.verify(hooks.got[0]!.body, hooks.got[0]!.headers)).toThrow();
  });

  it("resolves a credits alert when a top-up lifts the balance back over the plan's threshold, and lists the deliveries", async () => {
    for (let i = 0; i < 8; i++) expect((await call(`${gateways[i % 3]!.url}/v1/pets`, prepaid.key)).status).toBe(200);
    await eventually(() => of(prepaid.id).length >= 1, 20_000, 'the crossing delivered');
    const topUp = await fetch(`${gateways[1]!.adminUrl}/admin/accounts/${prepaid.id}/credits`, {
      method: 'POST',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'idempotency-key': 'refill-1' },
      body: JSON.stringify({ amount: 10, reason: 'refill' }),
    });
    expect(topUp.status).toBe(201);
    await eventually(() => of(prepaid.id).length >= 2, 20_000, 'the resolution delivered');
    // The balance went past the grant: a resolution reports none of it used, never a negative use.
    expect(of(prepaid.id).map((b) => [b.type, b.data.window, b.data.threshold, b.data.used])).toEqual([
      ['quota.threshold.crossed', 'credits', 0.8, 8],
      ['quota.threshold.resolved', 'credits', 0.8, 0],
    ]);
    const listed = await (
      await fetch(`${gateways[2]!.adminUrl}/admin/alerts/deliveries`, { headers: { authorization: `Bearer ${TOKEN}` } })
    ).json();
    expect(listed.deliveries.length).toBe(hooks.got.length);
    expect(listed.deliveries.every((d: { status: number }) => d.status === 204)).toBe(true);
  });
});

describe("a stale dispatcher's alerts cursor move", () => {
  it('is refused for an older fencing token or an older cursor', async () => {
    const redis = testClient(inject('redisUrl'));
    defineCursorScripts(redis);
    const name = `${uniquePrefix()}:{k:acct}`;
    const [a, b] = [
      (await redis.xadd(`${name}:alerts`, '*', 'kind', 'crossed'))!,
      (await redis.xadd(`${name}:alerts`, '*', 'kind', 'crossed'))!,
    ];
    const cursor = () => redis.get(`${name}:alerts:cursor`);
    expect(await moveAlertsCursor(redis, name, 7, '0-0', a)).toBe('moved');
    expect(await moveAlertsCursor(redis, name, 6, a, b)).toBe('fenced'); // a dispatcher that led before token 7's
    expect(await moveAlertsCursor(redis, name, 7, '0-0', a)).toBe('raced'); // a move from a cursor read before the last one
    expect(await cursor()).toBe(a);
    expect(await moveAlertsCursor(redis, name, 8, a, b)).toBe('moved');
    expect(await moveAlertsCursor(redis, name, 7, b, b)).toBe('fenced');
    expect(await cursor()).toBe(b);
    await redis.quit();
  });
});
