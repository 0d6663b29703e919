import { readFileSync } from 'node:fs';
import { connect } from 'node:net';
import { describe, expect, it } from 'vitest';
import { generateKey } from '../../gateway/auth/keys.js';
import { GATEWAY_ERRORS } from '../../gateway/errors.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { useTestGateway } from '../helpers/gateway.js';
import { eventually, inOneMinute } from '../helpers/time.js';

// The gateway's HTTP surface: authentication, the headers on every status, the answers made
// outside fastify. In-process gateway on real Redis, in front of the real pet backend
// (in-process too), so 201, validation 400s and the 404 for a missing pet are the backend's own.
const active = makeKey('free');
const revoked = { ...makeKey('free'), revokedAt: '2026-01-01T00:00:00Z' };
const plans = { free: { perMinute: 1000, perDay: 100000 } };
const gw = useTestGateway({
  config: testConfig([active, revoked], { plans, unauthenticated: { perMinute: 500 } }),
  backend: 'pets',
  // No leases (QUOTA_LEASE_MAX=1): the headers then step by one per request, so each status is seen to count.
  settings: { bodyLimit: 2048, quotaLeaseMax: 1 },
});

/** Sends raw bytes and returns the raw answer, for what fetch will not send. */
function raw(bytes: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const s = connect(gw.port, '127.0.0.1');
    let text = '';
    s.on('data', (c) => {
      text += c;
    });
    s.on('end', () => resolve(text));
    s.on('error', reject);
    s.setTimeout(5000, () => {
      s.destroy();
      reject(new Error(`no answer; got: ${text}`));
    });
    s.write(bytes);
  });
}

function parseRaw(text: string) {
  const [head, body] = text.split('\r\n\r\n');
  const [status, ...lines] = head!.split('\r\n');
  const headers = Object.fromEntries(lines.map((l) => [l.slice(0, l.indexOf(':')).toLowerCase(), l.slice(l.indexOf(':') + 1).trim()]));
  return { status: Number(status!.split(' ')[1]), headers, body: JSON.parse(body!) };
}

function expectRateHeaders(headers: Headers, limit: number) {
  expect(headers.get('x-ratelimit-limit')).toBe(String(limit));
  // Number(null) is 0: the header must be there, as digits, before its value means anything.
  expect(headers.get('x-ratelimit-remaining')).toMatch(/^\d+$/);
  expect(Number(headers.get('x-ratelimit-remaining'))).toBeLessThanOrEqual(limit);
  expect(headers.get('x-ratelimit-reset')).toMatch(/^\d+$/);
  const reset = Number(headers.get('x-ratelimit-reset'));
  expect(reset * 1000).toBeGreaterThan(Date.now() - 1000);
  expect(reset * 1000).toBeLessThan(Date.now() + 86_400_000 + 1000);
  expect(headers.get('ratelimit-policy')).toMatch(/^"minute";q=\d+;w=60/);
  expect(headers.get('ratelimit')).toMatch(/^"minute";r=\d+;t=\d+/);
  expect(headers.get('x-request-id')).toBeTruthy();
}

describe('authentication', () => {
  const wrongEnv = generateKey('staging').key;
  it.each([
    ['no header', undefined, /Missing API key/],
    ['another scheme', 'Basic dXNlcjpwYXNz', /Authorization must be "Bearer <API key>"/],
    ['a bearer that is not a key', 'Bearer not-a-key', /Malformed/],
    ['an empty bearer', 'Bearer ', /The bearer token is empty/],
    ['an unknown key', `Bearer ${generateKey('production').key}`, /Unknown API key/],
    ['a revoked key', `Bearer ${revoked.key}`, /revoked/],
    ['a key of the other environment', `Bearer ${wrongEnv}`, /staging environment/],
  ])('refuses %s with 401, WWW-Authenticate and the per-address limit headers', async (_, authorization, message) => {
    const res = await fetch(`${gw.url}/v1/pets`, { headers: authorization ? { authorization } : {} });
    expect(res.status).toBe(401);
    expect(res.headers.get('www-authenticate')).toMatch(/^Bearer realm="pet-store"/);
    const body = await res.json();
    expect(body).toEqual({ code: 'unauthorized', message: expect.stringMatching(message), status: 401 });
    expect(JSON.stringify(body)).not.toContain(wrongEnv);
    expectRateHeaders(res.headers, 500);
    expect(res.headers.get('ratelimit-policy')).toBe('"minute";q=500;w=60');
  });

  it('accepts the scheme in any case', async () => {
    const res = await fetch(`${gw.url}/v1/pets`, { headers: { authorization: `bEaReR ${active.key}` } });
    expect(res.status).toBe(200);
  });

  it('authenticates before routing: an unknown path without a key is a 401, not a 404', async () => {
    expect((await gw.call('/v1/secret')).status).toBe(401);
    expect((await gw.call('/v1/secret', active.key)).status).toBe(404);
  });
});

describe('headers on every status', () => {
  it('carries the key limit headers on 200, 201, 400, 404, 405 and 413, and each of them counts', async () => {
    const post = (body: string) =>
      gw.call('/v1/pets', active.key, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
    gw.freshCounters(); // the key's minute starts at zero here, whatever ran before
    await inOneMinute(async () => {
      const answers = [
        [await gw.call('/v1/pets', active.key), 200],
        [await post('{"name":"Rex","categoryId":1}'), 201],
        [await post('{"name":""}'), 400],
        [await gw.call('/v1/pets/999999', active.key), 404],
        [await gw.call('/nowhere', active.key), 404],
        [await gw.call('/v1/pets', active.key, { method: 'DELETE' }), 405],
        [await post(JSON.stringify({ name: 'x'.repeat(4000), categoryId: 1 })), 413],
      ] as const;
      // Fresh counters: the first request leaves 999, and every later one, whatever its status, one fewer.
      expect(answers[0][0].headers.get('x-ratelimit-remaining')).toBe('999');
      answers.forEach(([res, status], i) => {
        expect(res.status).toBe(status);
        expectRateHeaders(res.headers, 1000);
        expect(res.headers.get('ratelimit-policy')).toBe('"minute";q=1000;w=60, "day";q=100000;w=86400');
        expect(res.headers.get('x-ratelimit-remaining')).toBe(String(999 - i)); // every outcome counts once
        expect(Number(res.headers.get('x-ratelimit-reset'))).toBe(Math.ceil(Date.now() / 60_000) * 60);
      });
    }, gw.freshCounters);
  });

  it('answers routes outside the allow-list itself: 404, and 405 with Allow', async () => {
    // The gateway's own messages: the backend would answer these codes too, in other words.
    const missing = await gw.call('/v1/store/inventory', active.key);
    expect(missing.status).toBe(404);
    expect(await missing.json()).toEqual({ code: 'route_not_found', message: 'No such route', status: 404 });
    const res = await gw.call('/v1/pets/1', active.key, { method: 'DELETE' });
    expect(res.status).toBe(405);
    expect(res.headers.get('allow')).toBe('GET, HEAD');
    expect(await res.json()).toEqual({
      code: 'method_not_allowed',
      message: 'Method DELETE is not allowed here; use GET, HEAD',
      status: 405,
    });
  });

  it('adds Deprecation, Sunset and Link to the deprecated route, errors included, and only there', async () => {
    const found = await gw.call('/v1/pets/999999', active.key);
    expect(found.status).toBe(404);
    expect(found.headers.get('deprecation')).toBe('@1735689600');
    expect(found.headers.get('sunset')).toBe('Thu, 05 Dec 2030 00:00:00 GMT');
    expect(found.headers.get('link')).toBe('</v1/pets>; rel="successor-version"');
    const bad = await gw.call('/v1/pets/abc', active.key);
    expect(bad.status).toBe(400);
    expect(bad.headers.get('deprecation')).toBe('@1735689600');
    const list = await gw.call('/v1/pets', active.key);
    expect(list.status).toBe(200);
    expect(list.headers.get('deprecation')).toBeNull();
    expect(list.headers.get('sunset')).toBeNull();
    expect(list.headers.get('link')).toBeNull();
  });

  it('refuses a chunked body over the limit with 413 at the gateway', async () => {
    const key = `Bearer ${active.key}`;
    const chunk = 'a'.repeat(1500);
    const text = await raw(
      `POST /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: ${key}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n` +
        `${chunk.length.toString(16)}\r\n${chunk}\r\n${chunk.length.toString(16)}\r\n${chunk}\r\n0\r\n\r\n`,
    );
    const res = parseRaw(text);
    expect(res.status).toBe(413);
    expect(res.body).toEqual({ code: 'payload_too_large', message: expect.any(String), status: 413 });
    expect(res.headers['x-ratelimit-limit']).toBe('1000');
  });

  it.each([
    ['a request without Host', 'GET /v1/pets HTTP/1.1\r\nConnection: close\r\n\r\n', 400, 'bad_request'],
    [
      'an Expect other than 100-continue',
      'GET /v1/pets HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nConnection: close\r\n\r\n',
      417,
      'expectation_failed',
    ],
    ['CONNECT', 'CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n', 405, 'method_not_allowed'],
    [
      'Content-Length with Transfer-Encoding',
      'POST /v1/pets HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n',
      400,
      'bad_request',
    ],
    ['oversized headers', `GET /v1/pets HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(20_000)}\r\n\r\n`, 431, 'headers_too_large'],
    ['a request line that is not HTTP', 'HELLO\r\n\r\n', 400, 'bad_request'],
    [
      'two Authorization fields, a valid key in each',
      `GET /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${active.key}\r\nauthorization: Bearer ${active.key}\r\nConnection: close\r\n\r\n`,
      400,
      'bad_request',
    ],
  ])('answers %s in the Error shape with the per-address headers', async (_, bytes, status, code) => {
    const res = parseRaw(await raw(bytes));
    expect(res.status).toBe(status);
    expect(res.headers['content-type']).toMatch(/^application\/json/);
    expect(res.body).toEqual({ code, message: expect.any(String), status });
    expect(res.headers['x-ratelimit-limit']).toBe('500');
    expect(res.headers['x-ratelimit-remaining']).toMatch(/^\d+$/);
    expect(res.headers['ratelimit-policy']).toBe('"minute";q=500;w=60');
  });

  it.each(['/v1/pets/..', '/v1/pets/%2e%2e/admin', '/v1/../etc/passwd'])('refuses the path %s without leaving /v1', async (path) => {
    const res = parseRaw(await raw(`GET ${path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${active.key}\r\nConnection: close\r\n\r\n`));
    expect(res.status).toBe(400);
    expect(res.body.code).toBe('invalid_path');
  });

  it('answers a URL it cannot decode in the Error shape, and records it', async () => {
    const res = parseRaw(await raw(`GET /%zz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${active.key}\r\nConnection: close\r\n\r\n`));
    expect(res.status).toBe(400);
    expect(res.body).toEqual({ code: 'invalid_path', message: expect.any(String), status: 400 });
    expect(res.headers['x-ratelimit-limit']).toBe('500');
    const id = res.headers['x-request-id'];
    expect(id).toMatch(/^[0-9a-f-]{36}$/);
    const line = await gw.waitForLog((l) => l.reqId === id && l.msg === 'request');
    expect(line).toMatchObject({ method: 'GET', status: 400, outcome: 'allowed', route: null });
    expect(line.ms).toEqual(expect.any(Number));
  });

  it('finishes a good pipelined request before refusing the bad one after it', async () => {
    const text = await raw(`GET /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${active.key}\r\n\r\n` + 'HELLO\r\n\r\n');
    const answers = text.match(/HTTP\/1\.1 \d{3}/g); // the 400 follows the 200's body directly
    expect(answers).toEqual(['HTTP/1.1 200', 'HTTP/1.1 400']);
  });

  it('keeps a well-formed client request id on answers made outside fastify', async () => {
    const res = parseRaw(
      await raw('GET /v1/pets HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nX-Request-Id: trace-417\r\nConnection: close\r\n\r\n'),
    );
    expect(res.status).toBe(417);
    expect(res.headers['x-request-id']).toBe('trace-417');
  });

  it('records the answers made outside fastify too', async () => {
    const res = parseRaw(await raw('GET /v1/pets HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nConnection: close\r\n\r\n'));
    expect(res.status).toBe(417);
    const id = res.headers['x-request-id'];
    expect(id).toMatch(/^[0-9a-f-]{36}$/);
    const line = await gw.waitForLog((l) => l.reqId === id && l.msg === 'request');
    expect(line).toMatchObject({ method: 'GET', status: 417, outcome: 'allowed', route: null });
    expect(line.ms).toEqual(expect.any(Number));
  });
});

describe('error catalogue', () => {
  it('lists every gateway code in docs/reference.md with its status', () => {
    const text = readFileSync(new URL('../../docs/reference.md', import.meta.url), 'utf8');
    const readme = text.slice(text.indexOf('\nGateway:'), text.indexOf('\nBackend (passed through'));
    expect(readme.length).toBeGreaterThan(100);
    for (const [code, status] of Object.entries(GATEWAY_ERRORS)) {
      expect(readme).toMatch(new RegExp(`\\|\\s*\`${code}\`\\s*\\|\\s*${status}\\s*\\|`));
    }
  });
});

describe('route costs', () => {
  const k = makeKey('free');
  const g = useTestGateway({
    config: testConfig([k], { plans: { free: { perMinute: 20, perDay: 1000, costs: { 'POST /v1/pets': 5 } } } }),
    backend: 'echo',
  });

  it('a route that costs 5 takes 5 units from every window, and the headers count units', async () => {
    await inOneMinute(async () => {
      g.freshCounters();
      const post = await g.call('/v1/pets', k.key, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: '{"name":"Rex","categoryId":1}',
      });
      expect(post.status).toBe(200); // the echo backend
      expect(post.headers.get('x-ratelimit-remaining')).toBe('15');
      expect(post.headers.get('ratelimit')).toMatch(/^"minute";r=15;t=\d+, "day";r=995;t=\d+$/);
      const get = await g.call('/v1/pets', k.key);
      expect(get.headers.get('x-ratelimit-remaining')).toBe('14');
      for (let i = 0; i < 2; i++)
        await g.call('/v1/pets', k.key, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' });
      // 14 - 10 = 4 left: a GET still fits, a POST (5) does not.
      const refused = await g.call('/v1/pets', k.key, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' });
      expect(refused.status).toBe(429);
      expect((await g.call('/v1/pets', k.key)).status).toBe(200);
    });
  });
});

describe('key expiry', () => {
  const roomy = { free: { perMinute: 1000, perDay: 100000 } };
  const expired = { ...makeKey('free'), expiresAt: '2026-01-01T00:00:00Z' };
  const soon = makeKey('free');
  // Its 3 s start when the gateway is built for this test, not when the file is loaded.
  const g = useTestGateway(() => ({
    config: testConfig([expired, { ...soon, expiresAt: new Date(Date.now() + 3000).toISOString() }], { plans: roomy }),
    backend: 'echo',
  }));

  it('an expired key gets 401 saying so; one that expires later works until then, with no reload', async () => {
    const res = await g.call('/v1/pets', expired.key);
    expect(res.status).toBe(401);
    expect((await res.json()).message).toBe('This API key expired at 2026-01-01T00:00:00.000Z');
    expect((await g.call('/v1/pets', soon.key)).status).toBe(200);
    await eventually(async () => (await g.call('/v1/pets', soon.key)).status === 401, 6000, 'the key expired');
  });
});

describe('CORS', () => {
  const k = makeKey('free');
  const app = 'https://app.example';
  const g = useTestGateway({
    config: testConfig([k], {
      plans: { free: { perMinute: 1000, perDay: 100000 } },
      unauthenticated: { perMinute: 1000 },
      cors: { origins: [app] },
    }),
    backend: 'echo',
  });

  it('answers a preflight from an allowed origin itself, without a key and without the backend', async () => {
    const seen = g.echo!.seen.length;
    const res = await fetch(`${g.url}/v1/pets`, {
      method: 'OPTIONS',
      headers: { origin: app, 'access-control-request-method': 'POST', 'access-control-request-headers': 'authorization, content-type' },
    });
    expect(res.status).toBe(204);
    expect(res.headers.get('access-control-allow-origin')).toBe(app);
    expect(res.headers.get('access-control-allow-methods')).toContain('POST');
    expect(res.headers.get('access-control-allow-headers')).toContain('authorization');
    expect(g.echo!.seen.length).toBe(seen);
  });

  it('lets a page of an allowed origin read the rate-limit headers, errors included; other origins get nothing', async () => {
    for (const key of [k.key, undefined]) {
      const res = await g.call('/v1/pets', key, { headers: { origin: app } });
      expect(res.status).toBe(key ? 200 : 401);
      expect(res.headers.get('access-control-allow-origin')).toBe(app);
      expect(res.headers.get('vary')).toMatch(/Origin/i);
      const exposed = res.headers.get('access-control-expose-headers')!.split(', ');
      for (const h of [
        'ratelimit',
        'ratelimit-policy',
        'x-ratelimit-remaining',
        'retry-after',
        'deprecation',
        'sunset',
        'link',
        'x-request-id',
      ]) {
        expect(exposed).toContain(h);
      }
    }
    const other = await g.call('/v1/pets', k.key, { headers: { origin: 'https://evil.example' } });
    expect(other.headers.get('access-control-allow-origin')).toBeNull();
    const preflight = await fetch(`${g.url}/v1/pets`, {
      method: 'OPTIONS',
      headers: { origin: 'https://evil.example', 'access-control-request-method': 'GET' },
    });
    expect(preflight.status).toBe(401); // not answered as a preflight: an unauthenticated request
    expect(preflight.headers.get('access-control-allow-origin')).toBeNull();
  });
});
