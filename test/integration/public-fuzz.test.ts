import fc from 'fast-check';
import { beforeAll, describe, expect, it } from 'vitest';
import { timeoutFor } from '../helpers/budget.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import {
  contractProblems,
  type Doc,
  fillPath,
  operations,
  type RawRequest,
  responseChecker,
  send,
  valueOf,
} from '../helpers/openapi-fuzz.js';

// The public port against its own document (GET /v1/openapi.json), as the admin fuzzer does:
// GET and HEAD of every read operation, with path and query values drawn from the document
// (valid ones, and any text), through the gateway to the real pet backend. Every answer is one
// the operation documents, valid per its schema, or an Error; never a 5xx it does not document.

const SEED = Number(process.env.FUZZ_SEED ?? 3232);

let gw: TestGateway;
let doc: Doc;
let check: ReturnType<typeof responseChecker>;
const key = { ...makeKey('enterprise'), limits: { perMinute: 1_000_000, perDay: 10_000_000 } };

beforeAll(async () => {
  gw = await buildTestGateway({ config: testConfig([key]), backend: 'pets' });
  doc = (await (await fetch(`${gw.url}/v1/openapi.json`)).json()) as Doc;
  check = responseChecker(doc);
}, timeoutFor());

describe('the public port against its own document (a fuzzer)', () => {
  it('answers GET and HEAD with drawn path and query values as documented', { timeout: timeoutFor(60_000) }, async () => {
    const reads = operations(doc).filter((o) => o.method === 'get');
    expect(reads.length).toBeGreaterThanOrEqual(3);
    for (const { path, method, op } of reads) {
      const param = (where: string) => (op.parameters ?? []).filter((p) => p.in === where);
      const values = (where: string) =>
        fc.record(
          Object.fromEntries(
            param(where).map((p) => [p.name, fc.oneof({ arbitrary: valueOf(doc, p.schema), weight: 3 }, fc.string({ maxLength: 12 }))]),
          ),
          {
            requiredKeys: param(where)
              .filter((p) => p.required)
              .map((p) => p.name),
          },
        );
      const requests = fc.record({ path: values('path'), query: values('query'), head: fc.boolean() }).map(({ path: p, query, head }) => {
        const q = new URLSearchParams(Object.entries(query).map(([k, v]) => [k, String(v)])).toString();
        const req: RawRequest = {
          method: head ? 'HEAD' : 'GET',
          path: fillPath(path, Object.fromEntries(Object.entries(p).map(([k, v]) => [k, String(v)]))) + (q ? `?${q}` : ''),
          headers: [['Authorization', `Bearer ${key.key}`]],
        };
        return req;
      });
      await fc.assert(
        fc.asyncProperty(requests, async (req) => {
          const res = await send(gw.port, req);
          const problems = contractProblems(doc, check, { path, method }, req, res);
          expect(problems.join('\n'), `${method} ${path}: ${JSON.stringify(req)} (FUZZ_SEED=${SEED})`).toBe('');
        }),
        { seed: SEED, numRuns: 60, endOnFailure: true },
      );
    }
  });

  it('answers a malformed chunk in a body it is reading with 400 in the Error shape (it waited for ever)', async () => {
    const res = await send(gw.port, {
      method: 'POST',
      path: '/v1/pets',
      headers: [
        ['Authorization', `Bearer ${key.key}`],
        ['Content-Type', 'application/json'],
      ],
      framing: 'chunked',
      body: 'zz\r\nabc\r\n0\r\n\r\n',
    });
    expect([res.status, res.body]).toEqual([400, '{"code":"bad_request","message":"Malformed HTTP request","status":400}']);
  });
});
