import { readFileSync } from 'node:fs';
import { Validator } from '@seriousme/openapi-schema-validator';
import type { FastifyInstance } from 'fastify';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { buildBackend } from '../../backend/app.js';
import { BACKEND_ERRORS } from '../../backend/errors.js';
import { encodeCursor } from '../../backend/paging.js';
import { PetStore } from '../../backend/store.js';

let store: PetStore;
let app: FastifyInstance;

async function build(bodyLimit = 1024 * 1024) {
  store = new PetStore(':memory:');
  app = await buildBackend({ bodyLimit, logLevel: 'silent' }, store);
}
beforeEach(() => build());
afterEach(async () => {
  await app.close();
  store.close();
});

const post = (payload: unknown, headers: Record<string, string> = {}) =>
  app.inject({
    method: 'POST',
    url: '/v1/pets',
    headers: { 'content-type': 'application/json', ...headers },
    payload: typeof payload === 'string' ? payload : JSON.stringify(payload),
  });

function seed(n: number, status: 'available' | 'pending' | 'sold' = 'available') {
  for (let i = 0; i < n; i++) store.addPet({ name: `pet${i}`, categoryId: 1, status });
}

function expectError(res: { statusCode: number; headers: Record<string, unknown>; json: () => unknown }, status: number, code?: string) {
  expect(res.statusCode).toBe(status);
  expect(String(res.headers['content-type'])).toMatch(/^application\/json/);
  const body = res.json() as Record<string, unknown>;
  expect(Object.keys(body).sort()).toEqual(['code', 'message', 'status']);
  expect(body.status).toBe(status);
  if (code) expect(body.code).toBe(code);
  expect(typeof body.message).toBe('string');
  return body;
}

describe('GET /v1/pets', () => {
  it('returns at most 20 by default, in id order', async () => {
    seed(25);
    const res = await app.inject('/v1/pets');
    expect(res.statusCode).toBe(200);
    const ids = res.json().map((p: { id: number }) => p.id);
    expect(ids).toEqual(Array.from({ length: 20 }, (_, i) => i + 1));
  });

  it('honours limit and filters by status', async () => {
    seed(3, 'sold');
    seed(3, 'pending');
    const res = await app.inject('/v1/pets?status=pending&limit=2');
    expect(res.json().map((p: { id: number; status: string }) => [p.id, p.status])).toEqual([
      [4, 'pending'],
      [5, 'pending'],
    ]);
  });

  it.each(['limit=0', 'limit=101', 'limit=-1', 'limit=1.5', 'limit=abc', 'limit=', 'limit=05', 'status=foo', 'status='])(
    'rejects %s with 400',
    async (q) => {
      const body = expectError(await app.inject(`/v1/pets?${q}`), 400, 'validation_failed');
      expect(body.message).toContain(q.split('=')[0]);
    },
  );

  it('accepts the bounds 1 and 100', async () => {
    seed(101);
    expect((await app.inject('/v1/pets?limit=1')).json()).toHaveLength(1);
    expect((await app.inject('/v1/pets?limit=100')).json()).toHaveLength(100);
  });

  it('pages with a rel="next" link that keeps limit and status, and none on the last page', async () => {
    seed(2, 'sold');
    seed(4, 'pending'); // ids 3..6
    const first = await app.inject('/v1/pets?status=pending&limit=2');
    expect(first.json().map((p: { id: number }) => p.id)).toEqual([3, 4]);
    const link = String(first.headers.link);
    const m = /^<(\/v1\/pets\?[^>]+)>; rel="next"$/.exec(link);
    expect(m).not.toBeNull();
    const next = new URL(m![1]!, 'http://x');
    expect(next.searchParams.get('limit')).toBe('2');
    expect(next.searchParams.get('status')).toBe('pending');
    const second = await app.inject(m![1]!);
    expect(second.json().map((p: { id: number }) => p.id)).toEqual([5, 6]);
    // A full last page: nothing follows, so no link.
    expect(second.headers.link).toBeUndefined();
  });

  it('rejects a cursor it did not issue', async () => {
    for (const c of ['zz', 'YWZ0ZXI6MA', Buffer.from('after:1x').toString('base64url'), `${encodeCursor(3)}=`]) {
      expectError(await app.inject(`/v1/pets?cursor=${encodeURIComponent(c)}`), 400, 'invalid_cursor');
    }
    expect((await app.inject(`/v1/pets?cursor=${encodeCursor(3)}`)).statusCode).toBe(200);
  });
});

describe('POST /v1/pets', () => {
  it('creates a pet with status defaulting to available, and a Location', async () => {
    const res = await post({ name: '  Rex  ', categoryId: 7 });
    expect(res.statusCode).toBe(201);
    expect(res.json()).toEqual({ id: 1, name: 'Rex', categoryId: 7, status: 'available' });
    expect(res.headers.location).toBe('/v1/pets/1');
    expect((await app.inject('/v1/pets/1')).json()).toEqual(res.json());
  });

  it('keeps a given status', async () => {
    expect((await post({ name: 'a', categoryId: 1, status: 'sold' })).json().status).toBe('sold');
  });

  it('counts the name length after trimming', async () => {
    expect((await post({ name: ` ${'a'.repeat(200)} `, categoryId: 1 })).statusCode).toBe(201);
    const tooLong = expectError(await post({ name: 'a'.repeat(201), categoryId: 1 }), 400, 'validation_failed');
    // Named the way the schema's own messages name a field: body.<field>: <what is wrong>.
    expect(tooLong.message).toBe('body.name: must be at most 200 characters after trimming');
    expect(expectError(await post({ name: 'a', categoryId: 'x' }), 400, 'validation_failed').message).toMatch(/^body\.categoryId: /);
  });

  it.each([
    ['missing name', { categoryId: 1 }],
    ['missing categoryId', { name: 'a' }],
    ['blank name', { name: '   ', categoryId: 1 }],
    ['empty name', { name: '', categoryId: 1 }],
    ['numeric name', { name: 5, categoryId: 1 }],
    ['string categoryId', { name: 'a', categoryId: '5' }],
    ['fractional categoryId', { name: 'a', categoryId: 1.5 }],
    ['zero categoryId', { name: 'a', categoryId: 0 }],
    ['unsafe categoryId', { name: 'a', categoryId: 2 ** 63 }],
    ['unknown status', { name: 'a', categoryId: 1, status: 'lost' }],
    ['an array', [{ name: 'a', categoryId: 1 }]],
    ['a string', 'pet'],
    ['null', null],
  ])('refuses %s with 400', async (_, body) => {
    expectError(await post(JSON.stringify(body)), 400, 'validation_failed');
    expect(store.listPets(10, 0)).toHaveLength(0);
  });

  it('refuses a body that is not JSON, or empty', async () => {
    expectError(await post('{"name":'), 400, 'malformed_json');
    expectError(await post(''), 400, 'malformed_json');
  });

  it('refuses a non-JSON content type with 415', async () => {
    const res = await app.inject({ method: 'POST', url: '/v1/pets', headers: { 'content-type': 'text/plain' }, payload: 'x' });
    expectError(res, 415, 'unsupported_media_type');
  });

  it('refuses a body over the limit with 413', async () => {
    await app.close();
    await build(64);
    expectError(await post({ name: 'a'.repeat(100), categoryId: 1 }), 413, 'payload_too_large');
  });

  describe('Idempotency-Key', () => {
    it('replays the first answer for a retry with the same key and body', async () => {
      const first = await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': '"k-1"' });
      const again = await post({ categoryId: 1, name: 'Rex' }, { 'idempotency-key': '"k-1"' });
      expect(first.statusCode).toBe(201);
      expect(again.statusCode).toBe(201);
      expect(again.json()).toEqual(first.json());
      expect(again.headers.location).toBe(first.headers.location);
      expect(again.headers['idempotent-replayed']).toBe('true');
      expect(store.listPets(10, 0)).toHaveLength(1);
    });

    it('treats a bare token like the quoted string', async () => {
      const a = await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': '"tok"' });
      const b = await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': 'tok' });
      expect(b.json().id).toBe(a.json().id);
    });

    it('answers 422 for the same key with another body', async () => {
      await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': '"k"' });
      expectError(await post({ name: 'Max', categoryId: 1 }, { 'idempotency-key': '"k"' }), 422, 'idempotency_key_reused');
      expect(store.listPets(10, 0)).toHaveLength(1);
    });

    it('scopes keys per consumer', async () => {
      const a = await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': '"k"', 'x-consumer-id': 'a' });
      const b = await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': '"k"', 'x-consumer-id': 'b' });
      expect(b.json().id).not.toBe(a.json().id);
    });

    it('forgets keys after 24 hours', async () => {
      const body = JSON.stringify({ name: 'Rex', categoryId: 1 });
      const day = 24 * 60 * 60 * 1000;
      const create = () => ({ status: 201, body, location: null });
      expect(store.idempotent('', 'k', 'f', 0, create).kind).toBe('created');
      expect(store.idempotent('', 'k', 'f', day - 1, create).kind).toBe('replay');
      expect(store.idempotent('', 'k', 'other', day, create).kind).toBe('created');
    });

    it.each(['""', '"a\\x"', 'two words', 'x'.repeat(256)])('refuses the malformed key %s', async (key) => {
      expectError(await post({ name: 'Rex', categoryId: 1 }, { 'idempotency-key': key }), 400, 'invalid_idempotency_key');
    });
  });
});

describe('GET /v1/pets/{petId}', () => {
  it('returns the pet, 404 when absent', async () => {
    seed(1);
    expect((await app.inject('/v1/pets/1')).json()).toEqual({ id: 1, name: 'pet0', categoryId: 1, status: 'available' });
    expectError(await app.inject('/v1/pets/2'), 404, 'pet_not_found');
  });

  it.each(['abc', '0', '-1', '1.5', '9007199254740992'])('refuses the id %s with 400', async (id) => {
    expectError(await app.inject(`/v1/pets/${id}`), 400, 'validation_failed');
  });
});

describe('GET /v1/store/orders', () => {
  it('is empty unless seeded, and pages like pets', async () => {
    expect((await app.inject('/v1/store/orders')).json()).toEqual([]);
    for (let i = 0; i < 3; i++) {
      store.addOrder({ petId: 1, quantity: 1, shipDate: '2026-01-01T00:00:00.000Z', status: 'placed', complete: false });
    }
    const res = await app.inject('/v1/store/orders?limit=2');
    expect(res.json()).toEqual([
      { id: 1, petId: 1, quantity: 1, shipDate: '2026-01-01T00:00:00.000Z', status: 'placed', complete: false },
      { id: 2, petId: 1, quantity: 1, shipDate: '2026-01-01T00:00:00.000Z', status: 'placed', complete: false },
    ]);
    expect(String(res.headers.link)).toMatch(/^<\/v1\/store\/orders\?limit=2&cursor=[^>]+>; rel="next"$/);
    expectError(await app.inject('/v1/store/orders?limit=0'), 400, 'validation_failed');
  });
});

describe('errors', () => {
  it('answers an unknown route with 404 and a known path with another method with 405', async () => {
    expectError(await app.inject('/v1/nope'), 404, 'route_not_found');
    const res = await app.inject({ method: 'DELETE', url: '/v1/pets/1' });
    expectError(res, 405, 'method_not_allowed');
    expect(res.headers.allow).toBe('GET, HEAD');
    expect((await app.inject({ method: 'PUT', url: '/v1/store/orders' })).statusCode).toBe(405);
  });

  it('answers errors raised before routing in the Error shape', async () => {
    expectError(await app.inject(`/v1/pets/${'1'.repeat(101)}`), 414, 'uri_too_long');
    expectError(await app.inject('/v1/pets/%zz'), 400, 'bad_request');
  });

  it('hides the detail of an internal error', async () => {
    store.close();
    const body = expectError(await app.inject('/v1/pets'), 500, 'internal_error');
    expect(body.message).toBe('Internal error');
    store = new PetStore(':memory:');
  });

  it('lists every code of the catalogue in docs/reference.md', () => {
    // Only the backend's table: several codes (bad_request, route_not_found…) are the gateway's too.
    const text = readFileSync(new URL('../../docs/reference.md', import.meta.url), 'utf8');
    const start = text.indexOf('\nBackend (passed through');
    const readme = text.slice(start, text.indexOf('\n## ', start));
    expect(start).toBeGreaterThan(0);
    expect(readme.split('\n').filter((l) => l.startsWith('| `'))).toHaveLength(Object.keys(BACKEND_ERRORS).length);
    for (const [code, status] of Object.entries(BACKEND_ERRORS)) {
      expect(readme).toMatch(new RegExp(`\\|\\s*\`${code}\`\\s*\\|\\s*${status}\\s*\\|`));
    }
  });
});

describe('OpenAPI', () => {
  it('is a valid OpenAPI 3.1 document with every operation', async () => {
    const res = await app.inject('/v1/openapi.json');
    expect(res.statusCode).toBe(200);
    const doc = res.json();
    expect(doc.openapi).toBe('3.1.0');
    const result = await new Validator().validate(doc);
    expect(result.errors ?? []).toEqual([]);
    expect(result.valid).toBe(true);
    expect(doc.paths['/v1/pets'].get.operationId).toBe('listPets');
    expect(doc.paths['/v1/pets'].post.operationId).toBe('createPet');
    expect(doc.paths['/v1/pets/{petId}'].get.deprecated).toBe(true);
    expect(doc.paths['/v1/store/orders'].get.operationId).toBe('listOrders');
    // Only the operations that exist: the 405 answers for other methods are not operations.
    const operations = Object.entries(doc.paths as Record<string, Record<string, unknown>>).flatMap(([path, ops]) =>
      Object.keys(ops).map((method) => `${method.toUpperCase()} ${path}`),
    );
    expect(operations.sort()).toEqual(['GET /v1/pets', 'GET /v1/pets/{petId}', 'GET /v1/store/orders', 'POST /v1/pets']);
    const newPet = doc.paths['/v1/pets'].post.requestBody.content['application/json'].schema;
    expect(newPet).toEqual({ $ref: '#/components/schemas/NewPet' });
    expect(doc.components.schemas.NewPet.description).toMatch(/without a status it is added as available/);
  });
});
