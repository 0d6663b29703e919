import { Validator } from '@seriousme/openapi-schema-validator';
import { Ajv2020 } from 'ajv/dist/2020.js';
import formats from 'ajv-formats';
import { beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import type { OpenApiDocument } from '../../gateway/http/openapi.js';
import { petsBackend } from '../helpers/backends.js';
import { documentTestConfig, testConfig } from '../helpers/config.js';
import { buildTestGateway, useTestGateway } from '../helpers/gateway.js';
import { freePort } from '../helpers/net.js';
import { inOneMinute } from '../helpers/time.js';

// The API's document as the gateway serves it: public, valid, and true. Every documented
// answer of every operation is driven against the running gateway and pet backend and checked
// against the document (status, body schema, required headers), or its absence is explained.

const { key, tiny, broke, config } = documentTestConfig(); // tiny: one request a minute, its second a 429; broke: 402

type Json = Record<string, unknown>;
type Doc = OpenApiDocument & { paths: Record<string, Record<string, Json & { responses: Record<string, Json> }>> };

describe('GET /v1/openapi.json through the gateway', () => {
  const gw = useTestGateway({ config, backend: 'pets' });
  let doc: Doc;
  beforeAll(async () => {
    doc = (await (await gw.call('/v1/openapi.json')).json()) as Doc;
  });

  it('is public: answered without a key and with a wrong one, with the per-address rate-limit headers', async () => {
    for (const res of [await gw.call('/v1/openapi.json'), await gw.call('/v1/openapi.json', 'psk_live_not-a-key')]) {
      expect(res.status).toBe(200);
      expect(res.headers.get('content-type')).toMatch(/^application\/json/);
      expect(res.headers.get('ratelimit-policy')).toBe('"minute";q=1000;w=60');
      expect(res.headers.get('x-request-id')).toBeTruthy();
    }
  });

  it('is a valid OpenAPI 3.1 document', async () => {
    const result = await new Validator().validate(doc as never);
    expect(result.errors ?? []).toEqual([]);
    expect(result.valid).toBe(true);
    expect(doc.openapi).toBe('3.1.0');
  });

  it('lists exactly the operations the gateway serves, each behind the bearer scheme but the document itself', () => {
    const ops = Object.entries(doc.paths).flatMap(([path, methods]) => Object.keys(methods).map((m) => `${m.toUpperCase()} ${path}`));
    expect(ops.sort()).toEqual([
      'GET /v1/me/statements/{period}',
      'GET /v1/me/usage',
      'GET /v1/openapi.json',
      'GET /v1/pets',
      'GET /v1/pets/{petId}',
      'GET /v1/store/orders',
      'HEAD /v1/me/statements/{period}',
      'HEAD /v1/me/usage',
      'HEAD /v1/openapi.json',
      'HEAD /v1/pets',
      'HEAD /v1/pets/{petId}',
      'HEAD /v1/store/orders',
      'POST /v1/pets',
    ]);
    expect(doc.security).toEqual([{ apiKey: [] }]);
    expect((doc.components as Json).securitySchemes).toEqual({ apiKey: expect.objectContaining({ type: 'http', scheme: 'bearer' }) });
    expect(doc.paths['/v1/openapi.json']!.get!.security).toEqual([]);
    expect(doc.paths['/v1/openapi.json']!.head!.security).toEqual([]);
    for (const [path, methods] of Object.entries(doc.paths)) {
      for (const [method, op] of Object.entries(methods)) {
        const statuses = Object.keys(op.responses);
        // The usage and statement routes never reach the backend: no 502 or 504.
        const backend = path.startsWith('/v1/me/') ? [] : ['502', '504'];
        const errors = ['429', ...backend, '503', 'default', ...(path === '/v1/openapi.json' ? [] : ['401'])];
        expect(statuses, `${method} ${path}`).toEqual(expect.arrayContaining(errors));
        for (const status of errors) {
          // HEAD: the same answers and headers as GET, without a body.
          const content = method === 'head' ? undefined : { 'application/json': { schema: { $ref: '#/components/schemas/Error' } } };
          expect(op.responses[status]!.content, `${method} ${path} ${status}`).toEqual(content);
        }
        expect(Object.keys(op.responses['429']!.headers as Json)).toContain('Retry-After');
        // Failing closed, the quota store's 503 knows the policy, not the windows' state.
        expect(Object.keys(op.responses['503']!.headers as Json)).toEqual(
          expect.arrayContaining(['RateLimit-Policy', 'Retry-After', 'X-Request-Id']),
        );
        expect(Object.keys(op.responses['503']!.headers as Json)).not.toContain('X-RateLimit-Remaining');
        for (const [status, r] of Object.entries(op.responses)) {
          if (status === '503') continue;
          expect(Object.keys(r.headers as Json), `${method} ${path} ${status}`).toEqual(
            expect.arrayContaining([
              'X-Request-Id',
              'RateLimit-Policy',
              'RateLimit',
              'X-RateLimit-Limit',
              'X-RateLimit-Remaining',
              'X-RateLimit-Reset',
            ]),
          );
        }
      }
    }
  });

  it('says what the service accepts and sends: Idempotency-Key, Location, Link, the deprecation', () => {
    const post = doc.paths['/v1/pets']!.post!;
    const idem = (post.parameters as Json[]).find((p) => p.name === 'idempotency-key')!;
    const pattern = new RegExp((idem.schema as { pattern: string }).pattern);
    for (const ok of ['"order-42"', 'order-42', `"${'x'.repeat(255)}"`]) expect(pattern.test(ok), ok).toBe(true);
    for (const bad of ['""', '"a\\x"', 'two words', 'x'.repeat(256)]) expect(pattern.test(bad), bad).toBe(false);
    expect(Object.keys(post.responses['201']!.headers as Json)).toEqual(expect.arrayContaining(['Location', 'Idempotent-Replayed']));
    expect(Object.keys(doc.paths['/v1/pets']!.get!.responses['200']!.headers as Json)).toContain('Link');
    const getPet = doc.paths['/v1/pets/{petId}']!.get!;
    expect(getPet.deprecated).toBe(true);
    expect(Object.keys(getPet.responses)).toContain('410');
    expect(Object.keys(getPet.responses['200']!.headers as Json)).toEqual(expect.arrayContaining(['Deprecation', 'Sunset', 'Link']));
    expect(doc.paths['/v1/pets']!.get!.deprecated).toBeUndefined();
  });

  it('every documented answer is reachable and matches the document, or is explained', async () => {
    const ajv = new Ajv2020({ strict: false });
    formats.default(ajv);
    ajv.addFormat('int64', { type: 'number', validate: (n: number) => Number.isSafeInteger(n) });
    ajv.addSchema(doc, 'api');
    const pointer = (...parts: string[]) => parts.map((p) => encodeURIComponent(p.replaceAll('~', '~0').replaceAll('/', '~1'))).join('/');
    const headerDef = (ref: Json) => (doc.components as { headers: Record<string, Json> }).headers[String(ref.$ref).split('/').pop()!]!;

    const json = (body: unknown, extra: Record<string, string> = {}) => ({
      method: 'POST',
      headers: { 'content-type': 'application/json', ...extra },
      body: JSON.stringify(body),
    });
    /** tiny's minute holds one request: call until refused (a new minute may admit one first). */
    const refused = async (path: string, init?: RequestInit) => {
      for (let i = 0; i < 3; i++) {
        const res = await gw.call(path, tiny.key, init);
        if (res.status === 429) return res;
      }
      throw new Error(`no 429 for ${path}`);
    };
    const created = await gw.call('/v1/pets', key.key, json({ name: 'Rex', categoryId: 1 }));
    await gw.call('/v1/pets', key.key, json({ name: 'Fido', categoryId: 2 }));
    const petPath = new URL(created.headers.get('location')!, gw.url).pathname;
    await gw.call('/v1/pets', key.key, json({ name: 'Odie', categoryId: 1 }, { 'idempotency-key': '"conformance"' }));

    // Headers larger than Node accepts: 431 headers_too_large, an answer only the default covers.
    const huge = { 'x-padding': 'a'.repeat(20_000) };
    /** Each documented answer, driven; GET's are driven again as HEAD (`method`) for the HEAD operation. */
    const drive: Record<string, Record<string, (method?: string) => Promise<Response>>> = {
      'GET /v1/pets': {
        200: (method) => gw.call('/v1/pets?limit=1', key.key, { method }),
        400: (method) => gw.call('/v1/pets?limit=0', key.key, { method }),
        401: (method) => gw.call('/v1/pets', undefined, { method }),
        402: (method) => gw.call('/v1/pets', broke.key, { method }),
        429: (method) => refused('/v1/pets', { method }),
        default: (method) => gw.call('/v1/pets', key.key, { method, headers: huge }),
      },
      'POST /v1/pets': {
        201: () => gw.call('/v1/pets', key.key, json({ name: 'Garfield', categoryId: 1 })),
        400: () => gw.call('/v1/pets', key.key, json({ name: 'Garfield', categoryId: 'one' })),
        401: () => gw.call('/v1/pets', undefined, json({ name: 'Garfield', categoryId: 1 })),
        402: () => gw.call('/v1/pets', broke.key, json({ name: 'Garfield', categoryId: 1 })),
        413: () => gw.call('/v1/pets', key.key, json({ name: 'x'.repeat(1_100_000), categoryId: 1 })),
        415: () => gw.call('/v1/pets', key.key, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: 'Garfield' }),
        422: () => gw.call('/v1/pets', key.key, json({ name: 'Other', categoryId: 1 }, { 'idempotency-key': '"conformance"' })),
        429: () => refused('/v1/pets', json({ name: 'Garfield', categoryId: 1 })),
        default: () => gw.call('/v1/pets', key.key, json({ name: 'Garfield', categoryId: 1 }, huge)),
      },
      'GET /v1/pets/{petId}': {
        200: (method) => gw.call(petPath, key.key, { method }),
        400: (method) => gw.call('/v1/pets/abc', key.key, { method }),
        401: (method) => gw.call(petPath, undefined, { method }),
        402: (method) => gw.call(petPath, broke.key, { method }),
        404: (method) => gw.call('/v1/pets/987654321', key.key, { method }),
        414: (method) => gw.call(`/v1/pets/${'1'.repeat(150)}`, key.key, { method }),
        429: (method) => refused(petPath, { method }),
        default: (method) => gw.call(petPath, key.key, { method, headers: huge }),
      },
      'GET /v1/store/orders': {
        200: (method) => gw.call('/v1/store/orders', key.key, { method }),
        400: (method) => gw.call('/v1/store/orders?limit=0', key.key, { method }),
        401: (method) => gw.call('/v1/store/orders', undefined, { method }),
        402: (method) => gw.call('/v1/store/orders', broke.key, { method }),
        429: (method) => refused('/v1/store/orders', { method }),
        default: (method) => gw.call('/v1/store/orders', key.key, { method, headers: huge }),
      },
      'GET /v1/me/usage': {
        200: (method) => gw.call('/v1/me/usage', key.key, { method }),
        401: (method) => gw.call('/v1/me/usage', undefined, { method }),
        default: (method) => gw.call('/v1/me/usage', key.key, { method, headers: huge }),
      },
      'GET /v1/me/statements/{period}': {
        400: (method) => gw.call('/v1/me/statements/yesterday', key.key, { method }),
        401: (method) => gw.call('/v1/me/statements/current', undefined, { method }),
        409: (method) => gw.call('/v1/me/statements/current', key.key, { method }),
        default: (method) => gw.call('/v1/me/statements/current', key.key, { method, headers: huge }),
      },
      'GET /v1/openapi.json': {
        200: (method) => gw.call('/v1/openapi.json', undefined, { method }),
        default: (method) => gw.call('/v1/openapi.json', undefined, { method, headers: huge }),
      },
    };
    // Answers this test cannot drive on this gateway, and where each is driven instead.
    const explained: Record<string, string> = {
      'GET /v1/openapi.json 429': 'the per-address limit: the next test, on a gateway with 2 a minute',
      'HEAD /v1/openapi.json 429': 'as GET',
      'GET /v1/me/usage 429': 'the per-address limit: me-usage.test.ts, on a gateway with 4 a minute',
      'HEAD /v1/me/usage 429': 'as GET',
      'GET /v1/me/statements/{period} 200': 'with a usage export only: statements.test.ts checks the body against this document',
      'HEAD /v1/me/statements/{period} 200': 'as GET',
      'GET /v1/me/statements/{period} 429': 'the per-address limit, as /v1/me/usage',
      'HEAD /v1/me/statements/{period} 429': 'as GET',
      'GET /v1/openapi.json 502': 'backend unreachable: the test after it',
      'GET /v1/pets/{petId} 410': 'after the sunset only: gateway-config.test.ts drives the 410 with a past sunset',
      'HEAD /v1/pets/{petId} 410': 'as GET',
      502: 'backend unreachable: gateway-upstream.test.ts (backend killed)',
      503: 'the quota store failing closed: openapi-client.test.ts (Redis frozen, QUOTA_STORE_FAILURE=closed)',
      504: 'backend too slow: gateway-upstream.test.ts (UPSTREAM_TIMEOUT_MS)',
    };

    for (const [path, methods] of Object.entries(doc.paths)) {
      for (const [method, op] of Object.entries(methods)) {
        const name = `${method.toUpperCase()} ${path}`;
        for (const [status, documented] of Object.entries(op.responses)) {
          const run = drive[name.replace(/^HEAD/, 'GET')]?.[status];
          if (!run) {
            expect(explained[`${name} ${status}`] ?? explained[status], `${name} ${status}: neither driven nor explained`).toBeTruthy();
            continue;
          }
          const res = await run(method.toUpperCase());
          const text = await res.text();
          if (status === 'default') {
            expect(Object.keys(op.responses), `${name} ${res.status}: ${text}`).not.toContain(String(res.status));
            expect(res.status, name).toBeGreaterThanOrEqual(400);
          } else {
            expect(res.status, `${name} ${status}: ${text}`).toBe(Number(status));
          }
          if (method === 'head') {
            expect(text, `${name} ${status}`).toBe('');
          } else {
            const body = JSON.parse(text);
            const check = ajv.getSchema(
              `api#/${pointer('paths', path, method, 'responses', status, 'content', 'application/json', 'schema')}`,
            );
            expect(check, `${name} ${status}: no schema`).toBeDefined();
            expect(check!(body), `${name} ${status}: ${JSON.stringify(check!.errors)} for ${text}`).toBe(true);
          }
          for (const [header, ref] of Object.entries((documented.headers ?? {}) as Record<string, Json>)) {
            if (headerDef(ref).required) expect(res.headers.get(header), `${name} ${status}: ${header}`).not.toBeNull();
          }
        }
        // Nothing the gateway documents answers 405.
        const res = await gw.call(path.replace('{petId}', '1'), key.key, {
          method: method.toUpperCase(),
          ...(method === 'post' ? json({ name: 'X', categoryId: 1 }) : {}),
        });
        expect(res.status, name).not.toBe(405);
      }
    }
    // And every driven answer is documented.
    for (const [name, statuses] of Object.entries(drive)) {
      const [method, path] = name.split(' ') as [string, string];
      expect(Object.keys(doc.paths[path]![method.toLowerCase()]!.responses)).toEqual(expect.arrayContaining(Object.keys(statuses)));
    }
  });

  it('POST /v1/openapi.json: 405 with Allow, never proxied', async () => {
    const res = await gw.call('/v1/openapi.json', undefined, { method: 'POST', body: '{}' });
    expect(res.status).toBe(405);
    expect(res.headers.get('allow')).toBe('GET, HEAD');
    expect((await res.json()).code).toBe('method_not_allowed');
  });
});

describe('GET /v1/openapi.json limits and faults', () => {
  it('counts against the per-address limit like any request without a key, whatever key it carries', async () => {
    const gw = await buildTestGateway({ config: testConfig([key], { unauthenticated: { perMinute: 2 } }), backend: 'pets' });
    const answers = await inOneMinute(
      async () => {
        const out: Response[] = [];
        for (let i = 0; i < 3; i++) out.push(await gw.call('/v1/openapi.json', key.key));
        return out;
      },
      () => gw.freshCounters(),
    );
    expect(answers.map((r) => r.status)).toEqual([200, 200, 429]);
    expect(answers[2]!.headers.get('retry-after')).toMatch(/^[1-9][0-9]?$/);
    expect((await answers[2]!.json()).code).toBe('rate_limited');
  });

  it('backend unreachable: 502 bad_gateway in the Error shape, and served once it answers', async () => {
    const port = await freePort();
    const gw = await buildTestGateway({ config, backend: `http://127.0.0.1:${port}` });
    const res = await gw.call('/v1/openapi.json');
    expect(res.status).toBe(502);
    expect(await res.json()).toEqual({ code: 'bad_gateway', message: 'The backend could not be reached', status: 502 });
    const backend = await petsBackend(port);
    onTestFinished(() => backend.close());
    expect((await gw.call('/v1/openapi.json')).status).toBe(200);
  });
});
