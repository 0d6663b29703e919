import { join } from 'node:path';
import fc from 'fast-check';
import { beforeAll, describe, expect, it } from 'vitest';
import { timeoutFor } from '../helpers/budget.js';
import { makeKey, tempDir, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import {
  contractProblems,
  type Doc,
  fillPath,
  type Operation,
  operations,
  type RawRequest,
  responseChecker,
  type Schema,
  send,
  valueOf,
  wrongTypeOf,
} from '../helpers/openapi-fuzz.js';

// The admin port against its own document, as schemathesis would run it (not installable here:
// npm only): for every operation, requests valid per its schemas and requests broken on purpose,
// over real sockets to a real gateway on the run's Redis. Every answer must be one the operation
// documents (its body valid per the schema) or an error in the Error shape; never a 5xx but a
// documented 503, never an empty body, never fastify's {error, message, statusCode}.
// Runs are bounded and the seed fixed; FUZZ_SEED=n tries another (a failure prints its seed).

const SEED = Number(process.env.FUZZ_SEED ?? 3232);
const TOKEN = 'admin-fuzz-token-0123456789abcdef';
const NAME = '^[a-z0-9_-]{1,64}$';

let gw: TestGateway;
let doc: Doc;
let port: number;
let check: ReturnType<typeof responseChecker>;
let known: Record<string, string[]>;

beforeAll(async () => {
  const { dir } = tempDir();
  const paying = { ...makeKey('prepaid'), account: 'acme' };
  const plain = makeKey('free');
  const plans = {
    free: { perMinute: 1000, perDay: 100_000 },
    prepaid: { perMinute: 1000, perDay: 100_000, credits: { grant: 5, every: 'month' as const } },
  };
  gw = await buildTestGateway({
    config: testConfig([paying, plain], { plans }),
    admin: { token: TOKEN },
    configFile: join(dir, 'gateway.yaml'),
  });
  port = Number(new URL(gw.adminUrl).port);
  doc = (await (await fetch(`${gw.adminUrl}/openapi.json`)).json()) as Doc;
  check = responseChecker(doc);
  // Names that exist, tried beside drawn ones, so requests get past "no such key".
  known = { [NAME]: ['acme', paying.id, plain.id, plain.id, 'prepaid', 'free'] };
}, timeoutFor());

const bodySchema = (op: Operation) => op.requestBody?.content['application/json']?.schema;
const params = (op: Operation, where: string) => (op.parameters ?? []).filter((p) => p.in === where);

/** A request to `path`/`method` valid per the operation's schemas, with the admin token where it asks for one. */
function validRequest(path: string, method: string, op: Operation): fc.Arbitrary<RawRequest> {
  const record = (list: Operation['parameters']) =>
    fc.record(Object.fromEntries((list ?? []).map((p) => [p.name, valueOf(doc, p.schema, known)])), {
      requiredKeys: (list ?? []).filter((p) => p.required).map((p) => p.name),
    });
  const schema = bodySchema(op);
  return fc
    .record({
      path: record(params(op, 'path')),
      headers: record(params(op, 'header')),
      body: schema ? valueOf(doc, schema, known) : fc.constant(undefined),
    })
    .map(({ path: values, headers, body }) => ({
      method: method.toUpperCase(),
      path: fillPath(path, values as Record<string, string>),
      headers: [
        ...(op.security ? ([['Authorization', `Bearer ${TOKEN}`]] as Array<[string, string]>) : []),
        ...Object.entries(headers).map(([k, v]) => [k, String(v)] as [string, string]),
        ...(body === undefined ? [] : ([['Content-Type', 'application/json']] as Array<[string, string]>)),
      ],
      body: body === undefined ? undefined : JSON.stringify(body),
    }));
}

type Mutation = (req: RawRequest) => fc.Arbitrary<RawRequest>;
const withHeaders = (req: RawRequest, headers: Array<[string, string]>) => ({ ...req, headers });
const named = (req: RawRequest, name: string) => req.headers.filter(([n]) => n.toLowerCase() === name);

/** Ways to break a valid request: its body, its headers, its path. */
function mutations(path: string, op: Operation): Mutation[] {
  const schema = bodySchema(op);
  const body = schema && (doc.paths[path] ? schema : undefined);
  const props = Object.entries(((body && body.properties) ?? {}) as Record<string, Schema>);
  const parsed = (req: RawRequest) => (req.body ? (JSON.parse(req.body) as Record<string, unknown>) : {});
  const out: Mutation[] = [
    // Bodies that are not JSON, or not the JSON an object is
    (req) =>
      fc.constantFrom('{', '{"amount":', 'null', '[]', '"x"', '{"a":1}}', '', '\u0000', '{"__proto__":{"x":1}}').map((text) => ({
        ...withHeaders(req, [...req.headers.filter(([n]) => n !== 'Content-Type'), ['Content-Type', 'application/json']]),
        body: text,
      })),
    (req) =>
      fc
        .constantFrom('text/plain', 'application/x-www-form-urlencoded', 'application/json; charset=latin1', 'multipart/form-data')
        .map((type) => ({
          ...withHeaders(req, [...req.headers.filter(([n]) => n !== 'Content-Type'), ['Content-Type', type]]),
          body: req.body ?? 'a=1',
        })),
    // The token: none, wrong, twice, not a bearer
    (req) =>
      fc
        .constantFrom<Array<[string, string]>>(
          [],
          [['Authorization', 'Bearer wrong-token-0123456789']],
          [
            ['Authorization', `Bearer ${TOKEN}`],
            ['Authorization', `Bearer ${TOKEN}`],
          ],
          [['Authorization', `Basic ${TOKEN}`]],
          [['Authorization', '']],
        )
        .map((auth) => withHeaders(req, [...auth, ...req.headers.filter(([n]) => n !== 'Authorization')])),
    // A header sent twice (the one the operation documents, or Content-Type), or one too large
    (req) => {
      const doubled = params(op, 'header').map((p) => p.name);
      return fc.constantFrom(...doubled, 'content-type', 'host').map((name) => {
        const value = named(req, name)[0]?.[1] ?? (name === 'content-type' ? 'application/json' : 'twice-0123');
        return withHeaders(req, [...req.headers, [name, `${value}-2`]]);
      });
    },
    (req) => fc.integer({ min: 17_000, max: 80_000 }).map((n) => withHeaders(req, [...req.headers, ['X-Big', 'a'.repeat(n)]])),
    // Path parameters and a query of any text
    (req) =>
      fc
        .oneof(fc.string({ maxLength: 80 }), fc.constantFrom('..', '%', 'A', ' ', 'x'.repeat(65), '\u00e9', '%2F'))
        .map((text) => ({ ...req, path: fillPath(path, Object.fromEntries(params(op, 'path').map((p) => [p.name, text]))) })),
    // Framing: chunks (well formed or not), both lengths, a bad length, an old or odd version, Expect
    (req) =>
      fc
        .constantFrom<Partial<RawRequest>>(
          { framing: 'chunked', body: `${(req.body ?? '').length.toString(16)}\r\n${req.body ?? ''}\r\n0\r\n\r\n` },
          { framing: 'chunked', body: 'zz\r\nabc\r\n0\r\n\r\n' },
          { framing: 'none', headers: [...req.headers, ['Content-Length', '-1']], body: '' },
          { framing: 'none', headers: [...req.headers, ['Content-Length', '2'], ['Content-Length', '3']], body: '{}' },
          { headers: [...req.headers, ['Transfer-Encoding', 'chunked']] },
          { version: 'HTTP/1.0' },
          { version: 'HTTP/2.0' },
          { headers: [...req.headers, ['Expect', '100-continue']] },
          { headers: [...req.headers, ['Expect', 'teapot']] },
          { headers: [...req.headers, ['Content-Encoding', 'gzip']] },
          { headers: [...req.headers, ['Bad Header', 'x']] },
          { method: req.method.toLowerCase() },
        )
        .map((change) => ({ ...req, ...change })),
    (req) => fc.constantFrom('?a=1&a=2', '?%zz', '?x=' + 'y'.repeat(3000), '?', '#frag').map((q) => ({ ...req, path: req.path + q })),
  ];
  for (const p of params(op, 'header'))
    out.push((req) =>
      fc
        .constantFrom('', ' ', 'caf\u00e9', 'x'.repeat(300))
        .map((v) => withHeaders(req, [...req.headers.filter(([n]) => n !== p.name), [p.name, v]])),
    );
  if (props.length > 0) {
    const required = (body?.required as string[] | undefined) ?? [];
    out.push(
      // One field of the wrong type
      (req) =>
        fc
          .constantFrom(...props)
          .chain(([name, s]) => wrongTypeOf(doc, s).map((v) => ({ ...req, body: JSON.stringify({ ...parsed(req), [name]: v }) }))),
      // A field the schema does not know
      (req) =>
        fc
          .string({ minLength: 1, maxLength: 8 })
          .filter((n) => !props.some(([p]) => p === n))
          .map((n) => ({ ...req, body: JSON.stringify({ ...parsed(req), [n]: 1 }) })),
    );
    if (required.length > 0)
      out.push((req) =>
        fc.constantFrom(...required).map((name) => {
          const rest = parsed(req);
          delete rest[name];
          return { ...req, body: JSON.stringify(rest) };
        }),
      );
  }
  return out;
}

/** Sends each drawn request and fails with every broken promise, the request that broke it and how to rerun. */
async function fuzz(what: string, requests: fc.Arbitrary<{ req: RawRequest; at?: { path: string; method: string } }>, numRuns: number) {
  await fc.assert(
    fc.asyncProperty(requests, async ({ req, at }) => {
      const res = await send(port, req);
      const problems = contractProblems(doc, check, at, req, res);
      const shown = { ...req, headers: req.headers.map(([n, v]) => [n, v.length > 100 ? `${v.slice(0, 40)}... (${v.length})` : v]) };
      expect(problems.join('\n'), `${what}: ${JSON.stringify(shown)} (FUZZ_SEED=${SEED})`).toBe('');
    }),
    { seed: SEED, numRuns, endOnFailure: true },
  );
}

describe('the admin port against its own document (a fuzzer)', () => {
  it('answers requests valid per the schemas as documented', { timeout: timeoutFor(60_000) }, async () => {
    expect(operations(doc).length).toBeGreaterThanOrEqual(15);
    for (const { path, method, op } of operations(doc))
      await fuzz(
        `${method} ${path}`,
        validRequest(path, method, op).map((req) => ({ req, at: { path, method } })),
        20,
      );
  });

  it('answers broken requests as documented or in the Error shape, never a 5xx', { timeout: timeoutFor(90_000) }, async () => {
    // Every way of breaking, on every operation: a few draws each, so none is left to the seed.
    for (const { path, method, op } of operations(doc)) {
      for (const [i, breaking] of mutations(path, op).entries()) {
        const requests = validRequest(path, method, op)
          .chain(breaking)
          .map((req) => ({ req, at: { path, method } }));
        await fuzz(`${method} ${path} (break #${i})`, requests, 5);
      }
    }
  });

  it('answers routes and methods it does not have in the Error shape', { timeout: timeoutFor(30_000) }, async () => {
    const paths = Object.keys(doc.paths);
    const methods = ['GET', 'HEAD', 'POST', 'PUT', 'DELETE', 'PATCH', 'OPTIONS', 'PROPFIND', 'TRACE'];
    const requests = fc
      .record({
        method: fc.constantFrom(...methods),
        path: fc.oneof(
          fc.constantFrom(...paths).map((p) => fillPath(p, { id: 'acme', account: 'acme' })),
          fc.webPath().map((p) => p || '/'),
          fc.stringMatching(/^\/admin\/[a-z/{}.%0-9]{0,30}$/),
        ),
        auth: fc.boolean(),
      })
      .map(({ method, path, auth }) => {
        const template = paths.find((p) => new RegExp(`^${p.replace(/\{[^}]+\}/g, '[^/?]+')}$`).test(path));
        const documented = template && doc.paths[template]?.[method === 'HEAD' ? 'get' : method.toLowerCase()];
        const req: RawRequest = { method, path, headers: auth ? [['Authorization', `Bearer ${TOKEN}`]] : [] };
        return { req, at: documented ? { path: template, method: method === 'HEAD' ? 'get' : method.toLowerCase() } : undefined };
      });
    await fuzz('any route', requests, 150);
  });
});
