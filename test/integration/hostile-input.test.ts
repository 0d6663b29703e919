import { connect } from 'node:net';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GatewayError } from '../../gateway/errors.js';
import { matchRoute } from '../../gateway/routes.js';
import { petsBackend } from '../helpers/backends.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { useTestGateway } from '../helpers/gateway.js';

// Hostile input, generated: methods, paths, query strings, header sets (duplicates, bare CR,
// huge, non-ASCII) and bodies, thrown as raw bytes at the gateway and at the backend. Whatever
// comes, each answers with a documented status, in the Error shape when it is an error, the
// gateway with its rate-limit headers, nothing the allow-list refuses reaches the backend,
// and both keep serving.

const key = { ...makeKey('enterprise'), limits: { perMinute: 1e9, perDay: 1e9 } };
const gw = useTestGateway({ config: testConfig([key], { unauthenticated: { perMinute: 1e9 } }), backend: 'echo' });

const GATEWAY_STATUSES = new Set([200, 400, 401, 404, 405, 408, 410, 413, 417, 429, 431, 502, 504]);
const BACKEND_STATUSES = new Set([200, 201, 400, 404, 405, 413, 414, 415, 422, 431]);

const method = fc.oneof(
  fc.constantFrom('GET', 'POST', 'PUT', 'DELETE', 'PATCH', 'OPTIONS', 'HEAD', 'TRACE'),
  fc.stringMatching(/^[A-Z]{1,10}$/),
);
const segment = fc.oneof(
  fc.constantFrom(
    'v1',
    'pets',
    'store',
    'orders',
    'openapi.json',
    '..',
    '.',
    '%2e%2e',
    '%2F',
    '%5c',
    'admin',
    '1',
    '0',
    '-1',
    '1.5',
    '99999999999999999999',
    '%zz',
    '%00',
    '%C3%A9',
    'x'.repeat(150),
  ),
  fc.string({ maxLength: 12 }).map(encodeURIComponent),
);
const path = fc.array(segment, { maxLength: 5 }).map((s) => `/${s.join('/')}`);
const query = fc.option(
  fc
    .array(
      fc.tuple(
        fc.constantFrom('limit', 'status', 'cursor', 'x'),
        fc.oneof(fc.constantFrom('0', '1', '100', '101', 'abc', '', 'sold', '%zz'), fc.string({ maxLength: 8 }).map(encodeURIComponent)),
      ),
      { maxLength: 3 },
    )
    .map((kv) => `?${kv.map(([k, v]) => `${k}=${v}`).join('&')}`),
  { nil: '' },
);
const auth = fc.constantFrom('valid', 'none', 'garbage', 'two', 'lowercase-scheme', 'empty');
const headerValue = fc.oneof(
  fc.stringMatching(/^[ -~]{0,40}$/),
  fc.constant('a\rb'), // a bare CR: refused by the parser
  fc.constant('\u00e9t\u00e9'), // not ASCII (sent as latin-1 bytes)
  fc.constant('x'.repeat(20_000)), // over the header size limit
);
const headers = fc.array(fc.tuple(fc.stringMatching(/^[A-Za-z][A-Za-z0-9-]{0,15}$/), headerValue), { maxLength: 4 });
const body = fc.option(fc.oneof(fc.constant('{"name":"Rex","categoryId":1}'), fc.json({ maxDepth: 2 }), fc.string({ maxLength: 60 })), {
  nil: undefined,
});
const contentType = fc.constantFrom('application/json', 'text/plain', 'application/x-www-form-urlencoded', '');
const request = fc.record({ method, path, query, auth, headers, body, contentType });
type Request = {
  method: string;
  path: string;
  query: string;
  auth: string;
  headers: Array<[string, string]>;
  body: string | undefined;
  contentType: string;
};

function rawRequest(r: Request, apiKey: string): string {
  const lines = [`${r.method} ${r.path}${r.query} HTTP/1.1`, 'Host: x'];
  if (r.auth === 'valid') lines.push(`Authorization: Bearer ${apiKey}`);
  if (r.auth === 'garbage') lines.push('Authorization: Bearer psk_live_not-a-key');
  if (r.auth === 'two') lines.push(`Authorization: Bearer ${apiKey}`, 'Authorization: Bearer psk_live_other');
  if (r.auth === 'lowercase-scheme') lines.push(`authorization: bearer ${apiKey}`);
  if (r.auth === 'empty') lines.push('Authorization:');
  for (const [k, v] of r.headers) lines.push(`${k}: ${v}`);
  if (r.body !== undefined) {
    if (r.contentType) lines.push(`Content-Type: ${r.contentType}`);
    lines.push(`Content-Length: ${Buffer.byteLength(r.body)}`);
  }
  lines.push('Connection: close');
  return `${lines.join('\r\n')}\r\n\r\n${r.body ?? ''}`;
}

interface Answer {
  status: number;
  headers: Map<string, string>;
  body: string;
}

function send(port: number, bytes: string): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const s = connect(port, '127.0.0.1');
    const chunks: Buffer[] = [];
    s.on('data', (c) => chunks.push(c));
    s.on('error', () => {}); // a reset after the answer is fine; no answer fails below
    s.on('close', () => {
      const text = Buffer.concat(chunks).toString('latin1');
      const end = text.indexOf('\r\n\r\n');
      const [statusLine, ...lines] = text.slice(0, end).split('\r\n');
      const headers = new Map(lines.map((l) => [l.slice(0, l.indexOf(':')).toLowerCase(), l.slice(l.indexOf(':') + 1).trim()]));
      resolve({ status: Number(statusLine?.split(' ')[1]), headers, body: text.slice(end + 4) });
    });
    s.setTimeout(5000, () => {
      s.destroy();
      reject(new Error(`no answer within 5 s to: ${JSON.stringify(bytes.slice(0, 200))}`));
    });
    s.write(Buffer.from(bytes, 'latin1')); // not end(): a half-closed socket is a different test
  });
}

/** The Error shape, with its status equal to the HTTP status (HEAD answers carry no body). */
function expectErrorShape(method: string, a: Answer): void {
  expect(a.headers.get('content-type')).toMatch(/^application\/json/);
  if (method === 'HEAD') return;
  expect(JSON.parse(a.body)).toEqual({ code: expect.stringMatching(/^[a-z_]+$/), message: expect.any(String), status: a.status });
}

describe('hostile input, generated (fast-check)', () => {
  it('the gateway: a documented status, the Error shape, the rate-limit headers, and nothing refused is proxied', async () => {
    await fc.assert(
      fc.asyncProperty(request, async (r) => {
        const seenBefore = gw.echo!.seen.length;
        const a = await send(gw.port, rawRequest(r, key.key));
        expect(GATEWAY_STATUSES.has(a.status), `status ${a.status} for ${r.method} ${r.path}${r.query}`).toBe(true);
        expect(a.headers.has('x-ratelimit-limit') && a.headers.has('ratelimit-policy'), `rate-limit headers on ${a.status}`).toBe(true);
        if (a.status >= 400) expectErrorShape(r.method, a);
        if (r.auth === 'two') expect([400, 431]).toContain(a.status); // 431 when a header is also too large
        // Only an allowed route with a valid key may reach the backend, and then only once.
        const reached = gw.echo!.seen.slice(seenBefore);
        for (const seen of reached) {
          expect(matchRoute(seen.method, seen.url) instanceof GatewayError, `${seen.method} ${seen.url} was proxied`).toBe(false);
          expect(seen.headers.authorization).toBeUndefined();
          expect(seen.headers['x-consumer-id']).toBe(key.id);
        }
        expect(reached.length).toBeLessThanOrEqual(1);
      }),
      { numRuns: Number(process.env.FC_RUNS ?? 300) },
    );
    // Still serving.
    expect((await gw.call('/v1/pets', key.key)).status).toBe(200);
  });

  describe('the backend', () => {
    let backend: Awaited<ReturnType<typeof petsBackend>>;
    beforeAll(async () => {
      backend = await petsBackend();
    });
    afterAll(() => backend.close());

    it('a documented status and the Error shape, whatever arrives', async () => {
      const port = Number(new URL(backend.url).port);
      await fc.assert(
        fc.asyncProperty(request, async (r) => {
          const a = await send(port, rawRequest(r, key.key));
          expect(BACKEND_STATUSES.has(a.status), `status ${a.status} for ${r.method} ${r.path}${r.query}: ${a.body.slice(0, 200)}`).toBe(
            true,
          );
          if (a.status >= 400) expectErrorShape(r.method, a);
        }),
        { numRuns: Number(process.env.FC_RUNS ?? 300) },
      );
      expect((await fetch(`${backend.url}/v1/pets`)).status).toBe(200);
    });
  });
});
