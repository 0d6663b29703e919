import { readFileSync } from 'node:fs';
import { request } from 'node:http';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { freePort } from '../helpers/net.js';
import { startProcess } from '../helpers/processes.js';
import { spawnRedis } from '../helpers/redis.js';
import { call, makeKey, startStack, testConfig } from '../helpers/stack.js';
import { roomInMinute, sleep } from '../helpers/time.js';

const ADMIN_TOKEN = 'admin-token-0123456789';
const k = makeKey('free'); // 5 a minute
const other = makeKey('free');
const spare = makeKey('free'); // untouched until Redis comes back

describe('admin port', () => {
  let stack: Awaited<ReturnType<typeof startStack>>;
  let redis: Awaited<ReturnType<typeof spawnRedis>>;
  beforeAll(async () => {
    redis = await spawnRedis(); // its own Redis, so this file can freeze it
    stack = await startStack(testConfig([k, other, spare]), { REDIS_URL: redis.url, ADMIN_TOKEN });
  });
  afterAll(async () => {
    await stack.stop();
    redis.stop();
  });

  const admin = (path: string, token?: string) =>
    fetch(`${stack.gateway.adminUrl}${path}`, { headers: token ? { authorization: `Bearer ${token}` } : {} });

  it('answers health and readiness', async () => {
    expect(await (await admin('/healthz')).json()).toEqual({ status: 'ok' });
    const ready = await admin('/readyz');
    expect(ready.status).toBe(200);
    expect(await ready.json()).toEqual({ status: 'ready', store: 'redis' });
  });

  it('shows a key usage that moves with its requests, behind the admin token', async () => {
    await roomInMinute(5000);
    const before = await (await admin(`/admin/keys/${k.id}/usage`, ADMIN_TOKEN)).json();
    expect(before).toMatchObject({ id: k.id, plan: 'free', revoked: false, limits: { perMinute: 5, perDay: 1000 } });
    for (let i = 0; i < 7; i++) await call(`${stack.gateway.url}/v1/pets`, k.key);
    const after = await (await admin(`/admin/keys/${k.id}/usage`, ADMIN_TOKEN)).json();
    expect(after.windows.minute).toEqual({ used: 5, remaining: 0, resetAt: expect.stringMatching(/:00\.000Z$/) });
    expect(after.windows.day.used).toBe(before.windows.day.used + 5);
    expect(after.recentRejections).toBe(2);
    expect(after.ban).toEqual({ active: false, until: null });
    expect(after.store).toBe('redis');

    for (const token of [undefined, 'wrong-token-0123456789']) {
      const res = await admin(`/admin/keys/${k.id}/usage`, token);
      expect(res.status).toBe(401);
      expect((await res.json()).code).toBe('unauthorized');
    }
    const missing = await admin('/admin/keys/nobody/usage', ADMIN_TOKEN);
    expect(missing.status).toBe(404);
    expect((await missing.json()).code).toBe('key_not_found');
  });

  it('serves Prometheus metrics with bounded labels and no key ids', async () => {
    await call(`${stack.gateway.url}/v1/pets`, other.key);
    await call(`${stack.gateway.url}/v1/pets`);
    const res = await admin('/metrics');
    expect(res.headers.get('content-type')).toMatch(/^text\/plain/);
    const text = await res.text();
    expect(text).toMatch(/^gateway_requests_total\{route="listPets",status="200",plan="free"\} \d+$/m);
    expect(text).toMatch(/^gateway_requests_total\{route="none",status="401",plan="none"\} \d+$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="minute"\} [1-9]\d*$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="unauthenticated"\} [1-9]\d*$/m);
    expect(text).toMatch(/^gateway_redis_duration_seconds_count [1-9]\d*$/m);
    expect(text).toMatch(/^gateway_upstream_duration_seconds_count\{route="listPets"\} [1-9]\d*$/m);
    expect(text).toMatch(/^gateway_bans_active 0$/m);
    expect(text).toMatch(/^gateway_quota_store_degraded 0$/m);
    expect(text).not.toContain(k.id);
    expect(text).not.toContain(other.id);
    expect(text).not.toContain(k.key);
  });

  it('shows a ban in the usage and the metrics', async () => {
    // k has 2 refusals this minute (above); with afterRejected 3, the 4th refusal bans.
    const codes = [];
    for (let i = 0; i < 2; i++) codes.push((await (await call(`${stack.gateway.url}/v1/pets`, k.key)).json()).code);
    expect(codes).toEqual(['rate_limited', 'key_banned']);
    const usage = await (await admin(`/admin/keys/${k.id}/usage`, ADMIN_TOKEN)).json();
    expect(usage.ban.active).toBe(true);
    expect(Date.parse(usage.ban.until) - Date.now()).toBeGreaterThan(890_000);
    const text = await (await admin('/metrics')).text();
    expect(text).toMatch(/^gateway_bans_active 1$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="banned"\} 1$/m);
  });

  it('keeps admin routes off the public port', async () => {
    expect((await call(`${stack.gateway.url}/metrics`, other.key)).status).toBe(404);
    expect((await call(`${stack.gateway.url}/admin/keys/${k.id}/usage`, other.key)).status).toBe(404);
  });

  it('writes one access line per request with id, key, plan, route, status, duration and decision', async () => {
    const res = await call(`${stack.gateway.url}/v1/pets`, other.key, { headers: { 'x-request-id': 'trace-42' } });
    expect(res.headers.get('x-request-id')).toBe('trace-42');
    const line = await stack.gateway.waitForLog((l) => l.reqId === 'trace-42' && l.msg === 'request');
    expect(line).toMatchObject({ key: other.id, plan: 'free', route: 'listPets', method: 'GET', status: 200, quota: 'allowed' });
    expect(typeof line.ms).toBe('number');
    expect(stack.gateway.logs.filter((l) => l.reqId === 'trace-42')).toHaveLength(1);
    expect(stack.gateway.output()).not.toContain(other.key);
  });

  it('keeps serving from the in-process store while Redis is frozen, and says so', async () => {
    redis.proc.kill('SIGSTOP');
    try {
      const res = await call(`${stack.gateway.url}/v1/pets/1`, other.key);
      expect([200, 404]).toContain(res.status); // served: the backend answered, whatever the pet
      expect(res.headers.get('x-ratelimit-limit')).toBe('5');
      await stack.gateway.waitForLog((l) => String(l.msg).startsWith('quota store: Redis failed'));
      expect(await (await admin('/metrics')).text()).toMatch(/^gateway_quota_store_degraded 1$/m);
      const ready = await admin('/readyz');
      expect(ready.status).toBe(503);
      expect((await ready.json()).message).toMatch(/redis/);
    } finally {
      redis.proc.kill('SIGCONT');
    }
    await sleep(1100); // the store tries Redis again after a second
    // (not `other`: its request that timed out may still have run once Redis woke, and counted)
    expect((await call(`${stack.gateway.url}/v1/pets`, spare.key)).status).toBe(200);
    expect(await (await admin('/metrics')).text()).toMatch(/^gateway_quota_store_degraded 0$/m);
  });

  it('reports the backend in readiness', async () => {
    stack.backend.proc.kill('SIGSTOP');
    try {
      const ready = await admin('/readyz');
      expect(ready.status).toBe(503);
      expect((await ready.json()).message).toMatch(/backend/);
    } finally {
      stack.backend.proc.kill('SIGCONT');
    }
  });
});

describe('admin token', () => {
  it('answers 401 to everyone when ADMIN_TOKEN is not set, and logs why', async () => {
    const stack = await startStack(testConfig([k]));
    try {
      const res = await fetch(`${stack.gateway.adminUrl}/admin/keys/${k.id}/usage`, {
        headers: { authorization: 'Bearer anything-at-all-0123' },
      });
      expect(res.status).toBe(401);
      expect((await res.json()).message).toMatch(/ADMIN_TOKEN is not configured/);
      expect(stack.gateway.logs.some((l) => /ADMIN_TOKEN is not set/.test(String(l.msg)))).toBe(true);
    } finally {
      await stack.stop();
    }
  });
});

describe('pretty logs', () => {
  it('prints human-readable lines with LOG_PRETTY=1', async () => {
    const [port, adminPort] = [await freePort(), await freePort()];
    const g = await startProcess(
      'dist/gateway/server.js',
      { GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), GATEWAY_CONFIG: 'config/gateway.yaml', LOG_PRETTY: '1' },
      { port: adminPort },
    );
    try {
      // pino-pretty writes from a worker thread, a little after the port opens.
      for (let i = 0; i < 50 && !/gateway ready/.test(g.output()); i++) await sleep(100);
      expect(g.output()).toMatch(/INFO \(\d+\): gateway ready/);
      expect(g.logs).toEqual([]); // no JSON lines
    } finally {
      await g.stop();
    }
  });
});

describe('graceful shutdown', () => {
  it('finishes a request in flight when SIGTERM arrives, then exits 0', async () => {
    const stack = await startStack(testConfig([k]));
    try {
      stack.backend.proc.kill('SIGSTOP'); // hold the request in the backend
      const answer = new Promise<{ status: number; body: string }>((resolve, reject) => {
        const req = request(`${stack.gateway.url}/v1/pets`, { headers: { authorization: `Bearer ${k.key}` } }, (res) => {
          let body = '';
          res.on('data', (c) => {
            body += c;
          });
          res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
        });
        req.on('error', reject);
        req.end();
      });
      await sleep(300);
      const exited = new Promise<number | null>((r) => stack.gateway.proc.once('exit', (code) => r(code)));
      stack.gateway.proc.kill('SIGTERM');
      await stack.gateway.waitForLog((l) => String(l.msg).startsWith('closing'));
      const ready = await fetch(`${stack.gateway.adminUrl}/readyz`);
      expect(ready.status).toBe(503);
      expect((await ready.json()).message).toMatch(/shutting down/);
      stack.backend.proc.kill('SIGCONT');
      const { status, body } = await answer;
      expect(status).toBe(200);
      expect(Array.isArray(JSON.parse(body))).toBe(true);
      expect(await exited).toBe(0);
    } finally {
      stack.backend.proc.kill('SIGCONT');
      await stack.stop();
    }
  });

  it('exits at once on a second signal', async () => {
    const stack = await startStack(testConfig([k]));
    try {
      stack.backend.proc.kill('SIGSTOP');
      const pending = call(`${stack.gateway.url}/v1/pets`, k.key).catch(() => 'cut');
      await sleep(300);
      const exited = new Promise<number | null>((r) => stack.gateway.proc.once('exit', (code) => r(code)));
      stack.gateway.proc.kill('SIGTERM');
      await stack.gateway.waitForLog((l) => String(l.msg).startsWith('closing'));
      stack.gateway.proc.kill('SIGTERM');
      expect(await exited).toBe(1);
      expect(await pending).toBe('cut');
    } finally {
      stack.backend.proc.kill('SIGCONT');
      await stack.stop();
    }
  });
});

describe('images', () => {
  it('run the same entries that npm start runs', () => {
    const pkg = JSON.parse(readFileSync('package.json', 'utf8'));
    expect(pkg.scripts.start).toBe('node dist/stack.js');
    const stack = readFileSync('stack.ts', 'utf8');
    const cmds = [...readFileSync('Dockerfile', 'utf8').matchAll(/^CMD \["node", "([^"]+)"\]$/gm)].map((m) => m[1]);
    expect(cmds).toEqual(['dist/backend/server.js', 'dist/gateway/server.js']);
    for (const entry of cmds) expect(stack).toContain(`'${entry}'`);
  });
});
