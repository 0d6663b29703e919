import { createServer, type IncomingHttpHeaders, request, type Server } from 'node:http';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { call, makeKey, startGateway, startStack, tempDir, testConfig, writeConfig } from '../helpers/stack.js';

const k = makeKey('free');
const config = testConfig([k], { plans: { free: { perMinute: 1000, perDay: 100000 } } });

describe('backend faults', () => {
  let stack: Awaited<ReturnType<typeof startStack>>;
  beforeAll(async () => {
    stack = await startStack(config, { UPSTREAM_TIMEOUT_MS: '500' });
  });
  afterAll(() => stack.stop());

  it('answers 504 in the Error shape when the backend is frozen, within the timeout', async () => {
    expect((await call(`${stack.gateway.url}/v1/pets`, k.key)).status).toBe(200);
    stack.backend.proc.kill('SIGSTOP');
    try {
      const started = Date.now();
      const res = await call(`${stack.gateway.url}/v1/pets`, k.key);
      expect(res.status).toBe(504);
      expect(await res.json()).toEqual({ code: 'gateway_timeout', message: expect.any(String), status: 504 });
      expect(res.headers.get('x-ratelimit-limit')).toBe('1000');
      expect(Date.now() - started).toBeLessThan(5000);
    } finally {
      stack.backend.proc.kill('SIGCONT');
    }
    expect((await call(`${stack.gateway.url}/v1/pets`, k.key)).status).toBe(200);
  });

  it('answers 502 without the backend address when the backend is gone, headers included', async () => {
    stack.backend.proc.kill('SIGKILL');
    await new Promise((r) => stack.backend.proc.once('exit', r));
    const res = await call(`${stack.gateway.url}/v1/pets/1`, k.key);
    expect(res.status).toBe(502);
    const body = await res.json();
    expect(body).toEqual({ code: 'bad_gateway', message: 'The backend could not be reached', status: 502 });
    expect(JSON.stringify(body)).not.toMatch(/127\.0\.0\.1|ECONNREFUSED/);
    expect(res.headers.get('x-ratelimit-remaining')).toMatch(/^\d+$/);
    expect(res.headers.get('deprecation')).toBe('@1735689600');
  });
});

describe('what crosses the gateway', () => {
  // An observation point in place of the backend: it records what it receives.
  let seen: IncomingHttpHeaders[] = [];
  let echo: Server;
  let gateway: Awaited<ReturnType<typeof startGateway>>;
  const dir = tempDir();

  beforeAll(async () => {
    echo = createServer((req, res) => {
      seen.push(req.headers);
      req.resume();
      req.on('end', () => {
        res.writeHead(200, {
          'content-type': 'application/json',
          connection: 'keep-alive, x-hop',
          'x-hop': 'secret',
          'proxy-authenticate': 'Basic',
        });
        res.end('[]');
      });
    });
    await new Promise<void>((r) => echo.listen(0, '127.0.0.1', r));
    const file = join(dir.dir, 'gateway.yaml');
    writeConfig(file, config);
    gateway = await startGateway({
      BACKEND_URL: `http://127.0.0.1:${(echo.address() as { port: number }).port}`,
      GATEWAY_CONFIG: file,
      REDIS_KEY_PREFIX: `echo${process.pid}`,
    });
  });
  afterAll(async () => {
    await gateway.stop();
    echo.close();
    dir.cleanup();
  });

  it('strips the client key, spoofed identity and hop-by-hop headers; adds consumer and request id', async () => {
    seen = [];
    const res = await call(`${gateway.url}/v1/pets`, k.key, {
      headers: {
        'x-consumer-id': 'admin',
        'x-consumer-plan': 'enterprise',
        'x-request-id': 'trace-abc.123',
        'proxy-authorization': 'Basic x',
        te: 'trailers',
        cookie: 'a=b',
        forwarded: 'for=6.6.6.6',
        'x-real-ip': '6.6.6.6',
        'x-forwarded-for': '6.6.6.6',
        'x-forwarded-host': 'evil.example',
      },
    });
    expect(res.status).toBe(200);
    const h = seen[0]!;
    expect(h.authorization).toBeUndefined();
    expect(JSON.stringify(h)).not.toContain(k.key);
    expect(h['x-consumer-id']).toBe(k.id);
    expect(h['x-consumer-plan']).toBe('free');
    expect(h['x-request-id']).toBe('trace-abc.123');
    expect(h['proxy-authorization']).toBeUndefined();
    expect(h.te).toBeUndefined();
    expect(h.forwarded).toBeUndefined();
    expect(h['x-real-ip']).toBeUndefined();
    expect(h['x-forwarded-host']).toBeUndefined();
    expect(h['x-forwarded-for']).toBe('127.0.0.1');
    expect(res.headers.get('x-request-id')).toBe('trace-abc.123');
    expect(res.headers.get('x-hop')).toBeNull();
    expect(res.headers.get('proxy-authenticate')).toBeNull();
  });

  it('replaces a malformed request id with its own', async () => {
    seen = [];
    const res = await call(`${gateway.url}/v1/pets`, k.key, { headers: { 'x-request-id': 'bad id\twith spaces' } });
    const id = res.headers.get('x-request-id');
    expect(id).toMatch(/^[0-9a-f-]{36}$/);
    expect(seen[0]!['x-request-id']).toBe(id);
  });

  it('forwards a client Keep-Alive or Expect header without failing', async () => {
    seen = [];
    // fetch will not send these, so node:http does.
    const status = await new Promise<number>((resolve, reject) => {
      const req = request(`${gateway.url}/v1/pets`, {
        method: 'POST',
        headers: {
          authorization: `Bearer ${k.key}`,
          'keep-alive': 'timeout=5',
          'content-type': 'application/json',
          expect: '100-continue',
        },
      });
      req.on('continue', () => req.end('{"name":"a","categoryId":1}'));
      req.on('response', (res) => {
        res.resume();
        resolve(res.statusCode ?? 0);
      });
      req.on('error', reject);
    });
    expect(status).toBe(200);
    expect(seen[0]!['keep-alive']).toBeUndefined();
    expect(seen[0]!.expect).toBeUndefined();
  });

  it('never forwards a request it refuses', async () => {
    seen = [];
    await call(`${gateway.url}/v1/pets`);
    await call(`${gateway.url}/v1/other`, k.key);
    await call(`${gateway.url}/v1/pets`, k.key, { method: 'PUT' });
    expect(seen).toEqual([]);
  });

  it('logs no key and no Authorization header', async () => {
    const wrong = `${k.key.slice(0, -1)}${k.key.endsWith('X') ? 'Y' : 'X'}`;
    await call(`${gateway.url}/v1/pets`, k.key);
    await call(`${gateway.url}/v1/pets`, wrong);
    const out = gateway.output();
    expect(out).not.toContain(wrong);
    expect(out).not.toContain(k.key.slice(9, -1));
    expect(out).toContain('"msg":"request"');
    expect(out).not.toContain(k.key);
    expect(out).not.toContain(k.key.slice(9));
    expect(out.toLowerCase()).not.toContain('bearer');
  });
});
