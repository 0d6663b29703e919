import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { Ajv2020, type ValidateFunction } from 'ajv/dist/2020.js';
import formats from 'ajv-formats';
import createClient from 'openapi-fetch';
import openapiTS, { astToString } from 'openapi-typescript';
import ts from 'typescript';
import { beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import type { OpenApiDocument } from '../../gateway/http/openapi.js';
import { BUDGET, timeoutFor } from '../helpers/budget.js';
import { documentTestConfig, makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, useTestGateway } from '../helpers/gateway.js';
import { spawnRedis } from '../helpers/redis.js';
import { inOneMinute } from '../helpers/time.js';

// The public document as a contract a generated client relies on. openapi-typescript turns the
// document the gateway serves into types, and a call to every operation through openapi-fetch
// must type-check against them. Then openapi-fetch calls every operation of the running gateway
// (and the pet backend behind it), and each answer's body and each documented header must
// match what the document says of that status, its errors included: 400, 404, 429, a rare
// answer under `default`, and the 503 of a quota store that fails closed.

const { key, tiny, config } = documentTestConfig(); // tiny: one request a minute, its second a 429

type Json = Record<string, unknown>;
interface Documented {
  headers?: Record<string, { $ref: string }>;
  content?: { 'application/json': { schema: Json } };
}
type Doc = OpenApiDocument & { paths: Record<string, Record<string, { responses: Record<string, Documented> }>> };
interface Answer {
  data?: unknown;
  error?: unknown;
  response: Response;
}

// What openapi-fetch is told of the paths here: anything. The generated types exist only once the
// test runs; the first test has the compiler hold a call to every operation to them.
interface AnyOperation {
  parameters: { query?: Json; header?: Json; path?: Json };
  requestBody?: { content: { 'application/json': unknown } };
  responses: Record<number, { content: { 'application/json': unknown } }>;
}
type AnyPaths = Record<string, { get: AnyOperation; post: AnyOperation; head: AnyOperation }>;

/** A call to every operation, written against the generated types: the compiler must accept it as it is. */
const EVERY_OPERATION = `
import createClient from 'openapi-fetch';
import type { components, paths } from './api.js';

type Schemas = components['schemas'];
export type Named = [Schemas['Pet'], Schemas['NewPet'], Schemas['PetStatus'], Schemas['Order'], Schemas['OrderStatus'], Schemas['Error'], Schemas['Usage'], Schemas['Statement']];

export async function everyOperation(baseUrl: string): Promise<Schemas['Pet'][]> {
  const client = createClient<paths>({ baseUrl, headers: { authorization: 'Bearer psk_live_...' } });
  const created = await client.POST('/v1/pets', {
    body: { name: 'Rex', categoryId: 1, status: 'pending' },
    params: { header: { 'idempotency-key': '"order-42"' } },
  });
  const id: number = created.data?.id ?? 1;
  const one = await client.GET('/v1/pets/{petId}', { params: { path: { petId: id } } });
  const status: Schemas['PetStatus'] | undefined = one.data?.status;
  const orders: Schemas['Order'][] | undefined = (await client.GET('/v1/store/orders', { params: { query: { limit: 1 } } })).data;
  const failed: Schemas['Error'] | undefined = (await client.GET('/v1/openapi.json')).error;
  await client.HEAD('/v1/pets', {});
  await client.HEAD('/v1/pets/{petId}', { params: { path: { petId: id } } });
  await client.HEAD('/v1/store/orders', {});
  await client.HEAD('/v1/openapi.json', {});
  const usage: Schemas['Usage'] | undefined = (await client.GET('/v1/me/usage', {})).data;
  const left: number | undefined = usage?.windows.minute.remaining;
  await client.HEAD('/v1/me/usage', {});
  const statement: Schemas['Statement'] | undefined = (await client.GET('/v1/me/statements/{period}', { params: { path: { period: 'current' } } })).data;
  const billed: number | undefined = statement?.totals.units;
  await client.HEAD('/v1/me/statements/{period}', { params: { path: { period: 'previous' } } });
  void [left, billed];
  // @ts-expect-error PetStatus has no "lost"
  await client.GET('/v1/pets', { params: { query: { status: 'lost' } } });
  // @ts-expect-error a NewPet has a name
  await client.POST('/v1/pets', { body: { categoryId: 1 } });
  void [status, orders, failed];
  return (await client.GET('/v1/pets', { params: { query: { limit: 2, status: 'available' } } })).data ?? [];
}
`;

describe('a client generated from the public document', () => {
  const gw = useTestGateway({ config, backend: 'pets' });
  let doc: Doc;
  let ajv: Ajv2020;
  const headerSchemas = new Map<string, ValidateFunction>();

  beforeAll(async () => {
    doc = (await (await gw.call('/v1/openapi.json')).json()) as Doc;
    ajv = new Ajv2020({ strict: false, allErrors: true });
    formats.default(ajv);
    ajv.addFormat('int64', { type: 'number', validate: (n: number) => Number.isSafeInteger(n) });
    ajv.addSchema(doc, 'api');
  });

  const pointer = (...parts: string[]) => parts.map((p) => encodeURIComponent(p.replaceAll('~', '~0').replaceAll('/', '~1'))).join('/');

  /** A header's value against its documented schema (an integer header arrives as digits). */
  function headerMatches(name: string, value: string): boolean {
    const component = name.split('/').pop()!;
    const { schema } = (doc.components as { headers: Record<string, { schema: Json }> }).headers[component]!;
    let check = headerSchemas.get(component);
    if (!check) headerSchemas.set(component, (check = ajv.compile(schema)));
    return check(schema.type === 'integer' && /^-?[0-9]+$/.test(value) ? Number(value) : value);
  }

  /** The answer is one the document gives this operation: its status (or `default`), its body, its headers. */
  function expectDocumented(method: 'get' | 'post' | 'head', path: string, { data, error, response }: Answer): void {
    const name = `${method.toUpperCase()} ${path} ${response.status}`;
    const responses = doc.paths[path]?.[method]?.responses;
    expect(responses, `${name}: no such operation`).toBeDefined();
    const status = String(response.status) in responses! ? String(response.status) : 'default';
    const documented = responses![status]!;
    if (status === 'default') expect(response.status, `${name}: only errors fall under default`).toBeGreaterThanOrEqual(400);
    const body = data ?? error;
    if (method === 'head') {
      expect(documented.content, name).toBeUndefined();
      expect(body, name).toBeUndefined();
    } else {
      const check = ajv.getSchema(`api#/${pointer('paths', path, method, 'responses', status, 'content', 'application/json', 'schema')}`);
      expect(check, `${name}: no body schema`).toBeDefined();
      expect(check!(body), `${name}: ${JSON.stringify(check!.errors)} for ${JSON.stringify(body)}`).toBe(true);
    }
    for (const [header, { $ref }] of Object.entries(documented.headers ?? {})) {
      const value = response.headers.get(header);
      const required = (doc.components as { headers: Record<string, { required?: boolean }> }).headers[$ref.split('/').pop()!]!.required;
      if (required) expect(value, `${name}: ${header}`).not.toBeNull();
      if (value !== null) expect(headerMatches($ref, value), `${name}: ${header}: ${value}`).toBe(true);
    }
    // And the other way: a header the document names somewhere is documented where it is sent.
    const here = new Set(Object.keys(documented.headers ?? {}).map((h) => h.toLowerCase()));
    const sent = [...response.headers.keys()].filter((h) => documentedHeaders().has(h) && !here.has(h));
    expect(sent, `${name}: sent but not documented for this answer`).toEqual([]);
  }

  /** Every header name some answer of the document lists, lower-cased. */
  let headerNames: Set<string> | undefined;
  function documentedHeaders(): Set<string> {
    headerNames ??= new Set(
      Object.values(doc.paths)
        .flatMap((methods) => Object.values(methods))
        .flatMap((op) => Object.values(op.responses))
        .flatMap((r) => Object.keys(r.headers ?? {}).map((h) => h.toLowerCase())),
    );
    return headerNames;
  }

  it('openapi-typescript: named types, and a call to every operation type-checks against them', {
    timeout: timeoutFor(BUDGET.typecheck),
  }, async () => {
    const source = astToString(await openapiTS(doc as never));
    for (const named of ['Pet', 'NewPet', 'PetStatus', 'Order', 'OrderStatus', 'Error', 'Usage']) {
      expect(source).toMatch(new RegExp(`^ {8}${named}: `, 'm'));
    }
    // The operations use them by name rather than repeating them.
    for (const use of ['NewPet"]', 'Pet"]', 'Pet"][]', 'Order"][]', 'Error"]']) {
      expect(source).toContain(`"application/json": components["schemas"]["${use};`);
    }
    const dir = mkdtempSync(join(tmpdir(), 'openapi-client-'));
    onTestFinished(() => rmSync(dir, { recursive: true, force: true }));
    writeFileSync(join(dir, 'api.ts'), source);
    writeFileSync(join(dir, 'every-operation.ts'), EVERY_OPERATION);
    const fetchTypes = join(dirname(createRequire(import.meta.url).resolve('openapi-fetch')), 'index.d.mts');
    const program = ts.createProgram([join(dir, 'every-operation.ts')], {
      strict: true,
      noEmit: true,
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.ESNext,
      moduleResolution: ts.ModuleResolutionKind.Bundler,
      lib: ['lib.es2022.d.ts', 'lib.dom.d.ts'],
      types: [],
      paths: { 'openapi-fetch': [fetchTypes] },
    });
    const problems = ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, '\n'));
    expect(problems).toEqual([]);
  });

  it('openapi-fetch: every operation answers as documented, bodies and headers', async () => {
    const client = createClient<AnyPaths>({ baseUrl: gw.url, headers: { authorization: `Bearer ${key.key}` } });
    const called = new Set<string>();
    const call = async (method: 'get' | 'post' | 'head', path: string, answer: Promise<Answer>, status: number) => {
      const res = await answer;
      expect(res.response.status, `${method.toUpperCase()} ${path}: ${JSON.stringify(res.error)}`).toBe(status);
      expectDocumented(method, path, res);
      called.add(`${method.toUpperCase()} ${path}`);
      return res;
    };

    for (const name of ['Rex', 'Fido', 'Odie']) {
      await call('post', '/v1/pets', client.POST('/v1/pets', { body: { name, categoryId: 1 } }), 201);
    }
    const idempotent = {
      body: { name: 'Garfield', categoryId: 2, status: 'pending' },
      params: { header: { 'idempotency-key': '"once"' } },
    };
    const created = await call('post', '/v1/pets', client.POST('/v1/pets', idempotent), 201);
    const replayed = await call('post', '/v1/pets', client.POST('/v1/pets', idempotent), 201);
    expect(replayed.response.headers.get('idempotent-replayed')).toBe('true');
    expect(replayed.data).toEqual(created.data);

    const page = await call('get', '/v1/pets', client.GET('/v1/pets', { params: { query: { limit: 2, status: 'available' } } }), 200);
    expect(page.data).toHaveLength(2);
    expect(page.response.headers.get('link')).toMatch(/rel="next"/);
    const petId = (created.data as { id: number }).id;
    const one = await call('get', '/v1/pets/{petId}', client.GET('/v1/pets/{petId}', { params: { path: { petId } } }), 200);
    expect(one.data).toEqual(created.data);
    expect(one.response.headers.get('deprecation')).toMatch(/^@[0-9]+$/);
    await call('get', '/v1/store/orders', client.GET('/v1/store/orders', { params: { query: { limit: 5 } } }), 200);
    await call('get', '/v1/openapi.json', client.GET('/v1/openapi.json', {}), 200);
    await call('head', '/v1/pets', client.HEAD('/v1/pets', { params: { query: { limit: 1 } } }), 200);
    await call('head', '/v1/pets/{petId}', client.HEAD('/v1/pets/{petId}', { params: { path: { petId } } }), 200);
    await call('head', '/v1/store/orders', client.HEAD('/v1/store/orders', {}), 200);
    await call('head', '/v1/openapi.json', client.HEAD('/v1/openapi.json', {}), 200);
    const mine = await call('get', '/v1/me/usage', client.GET('/v1/me/usage', {}), 200);
    expect(mine.data).toMatchObject({ plan: 'free', windows: { minute: { limit: 1000 } } });
    await call('head', '/v1/me/usage', client.HEAD('/v1/me/usage', {}), 200);
    // This gateway exports no usage: its statements answer 409 (statements.test.ts checks a 200's body against this document).
    const period = { params: { path: { period: 'current' } } };
    const off = await call('get', '/v1/me/statements/{period}', client.GET('/v1/me/statements/{period}', period), 409);
    expect(off.error).toMatchObject({ code: 'statements_not_enabled' });
    await call('head', '/v1/me/statements/{period}', client.HEAD('/v1/me/statements/{period}', period), 409);

    const operations = Object.entries(doc.paths).flatMap(([path, methods]) =>
      Object.keys(methods).map((m) => `${m.toUpperCase()} ${path}`),
    );
    expect([...called].sort()).toEqual(operations.sort());
  });

  it('openapi-fetch: a 400, a 404, a 429 and a rare answer (default) are as documented', async () => {
    const client = createClient<AnyPaths>({ baseUrl: gw.url, headers: { authorization: `Bearer ${key.key}` } });
    const expectAnswer = async (method: 'get' | 'post' | 'head', path: string, answer: Promise<Answer>, status: number, code?: string) => {
      const res = await answer;
      expect(res.response.status, `${method.toUpperCase()} ${path}`).toBe(status);
      if (code) expect((res.error as { code: string }).code).toBe(code);
      expectDocumented(method, path, res);
    };
    await expectAnswer('get', '/v1/pets', client.GET('/v1/pets', { params: { query: { limit: 0 } } }), 400, 'validation_failed');
    await expectAnswer(
      'post',
      '/v1/pets',
      client.POST('/v1/pets', { body: { name: 'x'.repeat(201), categoryId: 1 } }),
      400,
      'validation_failed',
    );
    await expectAnswer(
      'get',
      '/v1/pets/{petId}',
      client.GET('/v1/pets/{petId}', { params: { path: { petId: 987654321 } } }),
      404,
      'pet_not_found',
    );
    await expectAnswer('head', '/v1/pets/{petId}', client.HEAD('/v1/pets/{petId}', { params: { path: { petId: 987654321 } } }), 404);
    // Headers larger than Node's limit: 431 headers_too_large, answered before routing, under `default`.
    const huge = { 'x-padding': 'a'.repeat(20_000) };
    await expectAnswer('get', '/v1/store/orders', client.GET('/v1/store/orders', { headers: huge }), 431, 'headers_too_large');

    const limited = createClient<AnyPaths>({ baseUrl: gw.url, headers: { authorization: `Bearer ${tiny.key}` } });
    const refused = await inOneMinute(
      async () => [await limited.GET('/v1/pets', {}), await limited.GET('/v1/pets', {})],
      () => gw.freshCounters(),
    );
    expect(refused.map((r) => r.response.status)).toEqual([200, 429]);
    expect((refused[1]!.error as { code: string }).code).toBe('rate_limited');
    expectDocumented('get', '/v1/pets', refused[1]!);
  });

  it("NewPet's name: the document accepts exactly the names the service accepts, and bounds the names it returns", async () => {
    const client = createClient<AnyPaths>({ baseUrl: gw.url, headers: { authorization: `Bearer ${key.key}` } });
    const newPet = ajv.getSchema('api#/components/schemas/NewPet')!;
    const pet = ajv.getSchema('api#/components/schemas/Pet')!;
    // The limit counts characters (code points) once surrounding whitespace is trimmed.
    const names = [
      'Rex',
      'a'.repeat(200),
      ` ${'a'.repeat(200)}\n`,
      'a'.repeat(201),
      '🐶'.repeat(200),
      '🐶'.repeat(201),
      `a${' '.repeat(198)}b`,
      '   ',
      '',
    ];
    for (const name of names) {
      const body = { name, categoryId: 1 };
      const { response, data } = await client.POST('/v1/pets', { body });
      expect(response.status === 201, `${JSON.stringify(name).slice(0, 40)}: ${response.status}`).toBe(newPet(body));
      if (data) expect(pet(data), JSON.stringify(pet.errors)).toBe(true);
    }
    const stored = (doc.components as { schemas: Record<string, { properties: Record<string, Json> }> }).schemas.Pet!.properties.name;
    expect(stored).toMatchObject({ minLength: 1, maxLength: 200 });
  });

  it('openapi-fetch: the 503 of a quota store that fails closed is as documented', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const k = { ...makeKey('enterprise'), limits: { perMinute: 100, perDay: 100_000 } }; // no lease: a leased unit is served even then
    const failing = await buildTestGateway({
      config: testConfig([k], { unauthenticated: { perMinute: 1000 } }),
      backend: 'pets',
      redis: redis.url,
      settings: { quotaStoreFailure: 'closed' }, // the setting under test
    });
    const client = createClient<AnyPaths>({ baseUrl: failing.url, headers: { authorization: `Bearer ${k.key}` } });
    expect((await client.GET('/v1/pets', {})).response.status).toBe(200);
    redis.proc.kill('SIGSTOP');
    try {
      const answers = [
        ['get', '/v1/pets', () => client.GET('/v1/pets', {})],
        ['post', '/v1/pets', () => client.POST('/v1/pets', { body: { name: 'Rex', categoryId: 1 } })],
        ['get', '/v1/pets/{petId}', () => client.GET('/v1/pets/{petId}', { params: { path: { petId: 1 } } })],
        ['get', '/v1/openapi.json', () => client.GET('/v1/openapi.json', {})],
      ] as const;
      for (const [method, path, answer] of answers) {
        const res = await answer();
        expect(res.response.status, `${method} ${path}`).toBe(503);
        expect((res.error as { code: string }).code).toBe('quota_store_unavailable');
        expectDocumented(method, path, res);
      }
    } finally {
      redis.proc.kill('SIGCONT');
    }
  });
});
