import { readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { Validator } from '@seriousme/openapi-schema-validator';
import { Ajv2020 } from 'ajv/dist/2020.js';
import formats from 'ajv-formats';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { installPlainRawHandlers, plainClientErrorHandler } from '../../gateway/http/raw-answers.js';
import { buildAdmin } from '../../gateway/admin/app.js';
import { compileConfig, loadConfigFile, validateConfigFile } from '../../gateway/config/config.js';
import { ErrorBody } from '../../gateway/errors.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { MemoryQuotaStore } from '../../gateway/quota/memory-store.js';
import { echoBackend } from '../helpers/backends.js';
import { makeKey, tempDir, testConfig, writeConfig } from '../helpers/config.js';

// The admin port as a schema-first wing: its OpenAPI document is generated from the routes'
// TypeBox schemas, and the same schemas refuse a bad request with 400 in the Error shape,
// naming the field. The admin app listens on a real port, its key API edits a real config file;
// usage comes from the in-process store (admin.test.ts reads it from Redis).

const TOKEN = 'admin-token-0123456789';
const member = { ...makeKey('free'), account: 'acme' };

type Json = Record<string, unknown>;
type Operation = Json & { responses: Record<string, Json>; requestBody?: Json; security?: unknown };
type Doc = Json & { paths: Record<string, Record<string, Operation>>; components: Json & { schemas: Record<string, Json> } };

let adminUrl = '';
let configFile = '';
const closers: Array<() => Promise<unknown> | unknown> = [];
beforeAll(async () => {
  const { dir, cleanup } = tempDir();
  closers.push(cleanup);
  configFile = join(dir, 'gateway.yaml');
  const file = testConfig([member]);
  writeConfig(configFile, file);
  const backend = await echoBackend();
  closers.push(() => backend.close());
  // The config in force follows the file, as the runner's reload makes it: the key list pages over it.
  let config = compileConfig(validateConfigFile(file, 'test config'));
  let seen = statSync(configFile).mtimeMs;
  const inForce = () => {
    const now = statSync(configFile).mtimeMs;
    if (now !== seen) [seen, config] = [now, loadConfigFile(configFile)];
    return config;
  };
  const admin = await buildAdmin(
    { backendUrl: backend.url, adminToken: TOKEN, configFile, requestTimeoutMs: loadSettings({}).requestTimeoutMs },
    {
      config: inForce,
      store: new MemoryQuotaStore(),
      metrics: { contentType: 'text/plain', text: async () => '' },
      closing: () => false,
      log: pino({ level: 'silent' }),
      rawAnswers: { install: installPlainRawHandlers, clientError: plainClientErrorHandler },
    },
  );
  adminUrl = await admin.listen({ port: 0, host: '127.0.0.1' });
  closers.push(() => admin.close());
});
afterAll(async () => {
  for (const close of closers.reverse()) await close();
});

/** A POST with a JSON body (none when `body` is undefined), with the admin token unless told otherwise. */
const post = (path: string, body?: unknown, token: string | null = TOKEN) =>
  fetch(`${adminUrl}${path}`, {
    method: 'POST',
    headers: { ...(token && { authorization: `Bearer ${token}` }), ...(body !== undefined && { 'content-type': 'application/json' }) },
    ...(body !== undefined && { body: JSON.stringify(body) }),
  });
const get = (path: string) => fetch(`${adminUrl}${path}`, { headers: { authorization: `Bearer ${TOKEN}` } });
const document = async () => (await (await fetch(`${adminUrl}/openapi.json`)).json()) as Doc;
const operations = (doc: Doc) =>
  Object.entries(doc.paths).flatMap(([path, ops]) => Object.entries(ops).map(([method, op]) => ({ path, method, op })));

describe('the admin OpenAPI document, generated from the route schemas', () => {
  it('is a valid OpenAPI 3.1 document, with the bearer scheme and a declared tag on every operation', async () => {
    const doc = await document();
    const result = await new Validator().validate(doc as never);
    expect(result.errors ?? []).toEqual([]);
    expect(doc.openapi).toBe('3.1.0');
    expect((doc.components.securitySchemes as Json).adminToken).toEqual({ type: 'http', scheme: 'bearer', description: 'ADMIN_TOKEN' });
    const tags = (doc.tags as Array<{ name: string }>).map((t) => t.name);
    for (const { path, method, op } of operations(doc))
      expect(tags, `${method} ${path}`).toEqual(expect.arrayContaining(op.tags as string[]));
  });

  it('documents each request body: createKey takes NewKey, rotateKey a grace, setAccount settings, topUpCredits an amount and reason; all refuse unknown fields', async () => {
    const doc = await document();
    const bodies = Object.fromEntries(
      operations(doc)
        .filter(({ op }) => op.requestBody)
        .map(({ op }) => [op.operationId, (op.requestBody!.content as Record<string, { schema: Json }>)['application/json']!.schema]),
    );
    expect(Object.keys(bodies).sort()).toEqual(['createKey', 'rotateKey', 'setAccount', 'topUpCredits']);
    expect(bodies.topUpCredits).toMatchObject({ required: ['amount', 'reason'], additionalProperties: false });
    expect(bodies.createKey).toMatchObject({ type: 'object', required: ['plan'], additionalProperties: false });
    expect(Object.keys(bodies.createKey!.properties as Json)).toEqual(['plan', 'id', 'account', 'limits', 'expiresAt']);
    expect((bodies.createKey!.properties as Json).limits).toMatchObject({
      required: ['perMinute', 'perDay'],
      additionalProperties: false,
      properties: { perMinute: { type: 'integer', minimum: 1 }, perDay: { type: 'integer', minimum: 1 }, perMonth: { minimum: 1 } },
    });
    expect(bodies.setAccount).toMatchObject({ type: 'object', additionalProperties: false, minProperties: 1 });
    expect(Object.keys(bodies.setAccount!.properties as Json)).toEqual(['billingDay', 'credits']);
    expect(bodies.rotateKey).toMatchObject({ additionalProperties: false, properties: { grace: { type: 'string', default: '24h' } } });
  });

  it('puts every /admin/* operation behind the token, with its 401, and nothing else', async () => {
    const doc = await document();
    for (const { path, method, op } of operations(doc)) {
      const guarded = path.startsWith('/admin/');
      expect(op.security, `${method} ${path}`).toEqual(guarded ? [{ adminToken: [] }] : undefined);
      expect(Object.keys(op.responses).includes('401'), `${method} ${path}`).toBe(guarded);
    }
  });

  it("gives every error answer the one Error schema, the gateway's own", async () => {
    const doc = await document();
    expect(doc.components.schemas.Error).toEqual(JSON.parse(JSON.stringify(ErrorBody)));
    for (const { path, method, op } of operations(doc)) {
      for (const [status, answer] of Object.entries(op.responses)) {
        if (Number(status) < 400) continue;
        expect(answer.content, `${method} ${path} ${status}`).toEqual({
          'application/json': { schema: { $ref: '#/components/schemas/Error' } },
        });
        expect(answer.description, `${method} ${path} ${status}`).not.toBe('Default Response');
      }
    }
  });
});

describe('requests the schemas refuse', () => {
  const usage = (id: string) => () => get(`/admin/keys/${id}/usage`);
  it.each([
    [
      'limits.perMinute a string',
      () => post('/admin/keys', { plan: 'free', limits: { perMinute: '5', perDay: 100 } }),
      'body.limits.perMinute: Expected integer',
    ],
    [
      'limits below 1',
      () => post('/admin/keys', { plan: 'free', limits: { perMinute: 0, perDay: 100 } }),
      'body.limits.perMinute: Expected integer to be greater or equal to 1',
    ],
    ['no plan', () => post('/admin/keys', { id: 'no-plan' }), 'body.plan: Expected required property'],
    ['a plan that is not a string', () => post('/admin/keys', { plan: 5 }), 'body.plan: Expected string'],
    [
      'a misspelled field',
      () => post('/admin/keys', { plan: 'free', limit: { perMinute: 5, perDay: 100 } }),
      'body.limit: Unexpected property',
    ],
    ['no body at all', () => post('/admin/keys'), 'body: Expected object'],
    ['a grace that is not a string', () => post(`/admin/keys/${member.id}/rotate`, { grace: 24 }), 'body.grace: Expected string'],
    ['a malformed key id', usage('Not-An-Id'), "params.id: Expected string to match '^[a-z0-9_-]{1,64}$'"],
  ])('%s: 400 bad_request in the Error shape, naming the field, and the file untouched', async (_name, send, message) => {
    const before = readFileSync(configFile, 'utf8');
    const res = await send();
    expect(res.status).toBe(400);
    expect(res.headers.get('content-type')).toMatch(/^application\/json/);
    expect(await res.json()).toEqual({ code: 'bad_request', message, status: 400 });
    expect(readFileSync(configFile, 'utf8')).toBe(before);
  });

  it("text the schema leaves to the keys command's own checks is refused there, naming the field", async () => {
    const date = await post('/admin/keys', { plan: 'free', expiresAt: 'tomorrow' });
    expect(date.status).toBe(400);
    expect(await date.json()).toEqual({
      code: 'bad_request',
      message: expect.stringMatching(/^expiresAt: an ISO 8601 date-time/),
      status: 400,
    });
    const grace = await post(`/admin/keys/${member.id}/rotate`, { grace: 'soon' });
    expect(grace.status).toBe(400);
    expect(await grace.json()).toEqual({ code: 'bad_request', message: expect.stringMatching(/^grace: /), status: 400 });
  });

  it('answers 401, not 400, to a bad body without the token: a stranger learns nothing of the schema', async () => {
    for (const token of [null, 'wrong-token-0123456789']) {
      const res = await post('/admin/keys', { limit: 'x' }, token);
      expect(res.status).toBe(401);
      expect(await res.json()).toEqual({ code: 'unauthorized', message: 'Admin token missing or wrong', status: 401 });
      expect(res.headers.get('www-authenticate')).toBe('Bearer realm="pet-store-admin"');
    }
  });
});

describe('what the admin port answers, as documented', () => {
  it('every success answer is whole and matches its documented schema: create, list, rotate (no body: 24h), revoke, account, usage', async () => {
    const doc = await document();
    const ajv = new Ajv2020({ strict: false });
    formats.default(ajv);
    ajv.addSchema(doc, 'admin');
    const pointer = (...parts: string[]) => parts.map((p) => encodeURIComponent(p.replaceAll('~', '~0').replaceAll('/', '~1'))).join('/');
    const answer = async (path: string, method: string, status: number, res: Response) => {
      const body = (await res.json()) as Json;
      expect(res.status, `${method} ${path}: ${JSON.stringify(body)}`).toBe(status);
      const check = ajv.getSchema(
        `admin#/${pointer('paths', path, method, 'responses', String(status), 'content', 'application/json', 'schema')}`,
      )!;
      expect(check(body), `${method} ${path}: ${JSON.stringify(check.errors)}`).toBe(true);
      return body;
    };

    const created = await answer(
      '/admin/keys',
      'post',
      201,
      await post('/admin/keys', { plan: 'free', id: 'made-here', account: 'made', limits: { perMinute: 7, perDay: 70 } }),
    );
    // The response schemas also serialise: a field they left out would be dropped silently.
    expect(Object.keys(created).sort()).toEqual(['id', 'key', 'note']);
    const listed = await answer('/admin/keys', 'get', 200, await get('/admin/keys'));
    expect(listed.keys).toContainEqual({
      id: 'made-here',
      account: 'made',
      plan: 'free',
      limits: { perMinute: 7, perDay: 70 },
      status: 'active',
      createdAt: expect.any(String),
    });
    const rotated = await answer('/admin/keys/{id}/rotate', 'post', 201, await post('/admin/keys/made-here/rotate'));
    // `stores`: where the key was changed (a key in the file and the registry is changed in both).
    const stores = [expect.stringMatching(/gateway\.yaml$/)];
    expect(rotated).toEqual({
      id: 'made-2',
      key: expect.any(String),
      account: 'made',
      plan: 'free',
      oldExpiresAt: expect.any(String),
      stores,
    });
    expect(Date.parse(String(rotated.oldExpiresAt)) - Date.now()).toBeGreaterThan(24 * 3_600_000 - 60_000);
    expect(await answer('/admin/keys/{id}/revoke', 'post', 200, await post('/admin/keys/made-2/revoke', {}))).toEqual({
      id: 'made-2',
      revokedAt: expect.any(String),
      stores,
    });
    const settings = { billingDay: 3, credits: { grant: 10, every: 'month', rollover: false } };
    const put = await fetch(`${adminUrl}/admin/accounts/made`, {
      method: 'PUT',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
      body: JSON.stringify(settings),
    });
    expect(await answer('/admin/accounts/{account}', 'put', 200, put)).toEqual({ account: 'made', ...settings });

    const byKey = await answer('/admin/keys/{id}/usage', 'get', 200, await get(`/admin/keys/${member.id}/usage`));
    expect(Object.keys(byKey).sort()).toEqual([
      'account',
      'at',
      'ban',
      'enforced',
      'id',
      'limits',
      'plan',
      'recentRejections',
      'revoked',
      'store',
      'windows',
    ]);
    expect(byKey.windows).toEqual({ minute: expect.any(Object), day: expect.any(Object) });
    const byAccount = await answer('/admin/accounts/{account}/usage', 'get', 200, await get('/admin/accounts/acme/usage'));
    expect(byAccount).toMatchObject({ keys: [member.id], account: 'acme', store: 'memory' });
    expect(await answer('/healthz', 'get', 200, await get('/healthz'))).toEqual({ status: 'ok' });
    expect(await answer('/readyz', 'get', 200, await get('/readyz'))).toEqual({ status: 'ready', store: 'memory' });
  });
});
