import { connect } from 'node:net';
import { Ajv2020, type ValidateFunction } from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';
import fc from 'fast-check';
import { BUDGET, scaled } from './budget.js';

// A small schemathesis over real sockets: requests drawn from an OpenAPI 3.1 document (valid per
// its schemas, or broken on purpose), sent as raw HTTP/1.1 so a header can be repeated or a body
// malformed, and every answer checked against what the document says that operation answers.

export type Schema = Record<string, unknown>;
export type Doc = { paths: Record<string, Record<string, Operation>>; components?: { schemas?: Record<string, Schema> } };
export interface Operation {
  operationId?: string;
  parameters?: Array<{ in: string; name: string; required?: boolean; schema: Schema }>;
  requestBody?: { required?: boolean; content: Record<string, { schema: Schema }> };
  responses: Record<string, { content?: Record<string, { schema: Schema }> }>;
  security?: unknown[];
}

/** One request as it goes on the wire: header fields in order (repeats allowed), the body as sent. */
export interface RawRequest {
  method: string;
  path: string;
  headers: Array<[string, string]>;
  body?: string;
  /** The body's framing when not a plain Content-Length: chunked (its chunks as given), or none at all. */
  framing?: 'chunked' | 'none';
  /** The request line's version: HTTP/1.1 unless given. */
  version?: string;
}
export interface RawAnswer {
  /** Set when the connection was still open this many ms after the request: the server waits for more. */
  late?: number;
  status: number;
  headers: Record<string, string[]>;
  body: string;
}

/** Sends one request on a fresh connection (Connection: close) and reads the whole answer. */
export async function send(port: number, req: RawRequest, ms = scaled(BUDGET.change)): Promise<RawAnswer> {
  const lines = [`${req.method} ${req.path} ${req.version ?? 'HTTP/1.1'}`, 'Host: 127.0.0.1', 'Connection: close'];
  for (const [name, value] of req.headers) lines.push(`${name}: ${value}`);
  const body = req.body === undefined ? Buffer.alloc(0) : Buffer.from(req.body);
  if (req.framing === 'chunked') lines.push('Transfer-Encoding: chunked');
  else if (req.body !== undefined && req.framing !== 'none') lines.push(`Content-Length: ${body.length}`);
  const socket = connect(port, '127.0.0.1');
  const chunks: Buffer[] = [];
  socket.on('data', (c: Buffer) => chunks.push(c));
  let late = false;
  socket.setTimeout(ms, () => {
    late = true;
    socket.destroy();
  });
  const ended = new Promise<void>((resolve) => {
    socket.once('close', () => resolve());
    socket.once('error', () => resolve()); // a reset after the answer, or no answer: judged from what came
  });
  // write, not end: a half-closed connection is one Node's server drops without answering a slow route.
  socket.write(Buffer.concat([Buffer.from(`${lines.join('\r\n')}\r\n\r\n`), body]));
  await ended;
  return { ...parseAnswer(Buffer.concat(chunks)), ...(late ? { late: ms } : {}) };
}

function parseAnswer(raw: Buffer): RawAnswer {
  // An interim answer (100 Continue) comes before the final one: skip it.
  while (/^HTTP\/1\.[01] 1\d\d /.test(raw.subarray(0, 16).toString('latin1'))) raw = raw.subarray(raw.indexOf('\r\n\r\n') + 4);
  const split = raw.indexOf('\r\n\r\n');
  if (split < 0) return { status: 0, headers: {}, body: raw.toString('latin1') };
  const [statusLine = '', ...fields] = raw.subarray(0, split).toString('latin1').split('\r\n');
  const headers: Record<string, string[]> = {};
  for (const f of fields) {
    const at = f.indexOf(':');
    const name = f.slice(0, at).trim().toLowerCase();
    (headers[name] ??= []).push(f.slice(at + 1).trim());
  }
  let rest = raw.subarray(split + 4);
  if (headers['transfer-encoding']?.[0] === 'chunked') {
    const parts: Buffer[] = [];
    for (;;) {
      const eol = rest.indexOf('\r\n');
      const size = Number.parseInt(rest.subarray(0, eol).toString(), 16);
      if (!(size > 0)) break;
      parts.push(rest.subarray(eol + 2, eol + 2 + size));
      rest = rest.subarray(eol + 4 + size);
    }
    rest = Buffer.concat(parts);
  } else if (headers['content-length']) rest = rest.subarray(0, Number(headers['content-length'][0]));
  return { status: Number(statusLine.split(' ')[1]), headers, body: rest.toString('utf8') };
}

/** The schema a `$ref` names (local references only). */
export function deref(doc: Doc, schema: Schema): Schema {
  const ref = schema.$ref;
  if (typeof ref !== 'string') return schema;
  const found = ref
    .replace(/^#\//, '')
    .split('/')
    .reduce<unknown>((at, part) => (at as Record<string, unknown>)?.[part.replace(/~1/g, '/').replace(/~0/g, '~')], doc);
  return deref(doc, found as Schema);
}

const MAX_INT = 2 ** 31 - 1;

/**
 * Values valid per `schema`. `known` maps a string pattern to values worth trying first (names
 * that exist), so a request reaches past "no such account" as often as it stops there.
 */
export function valueOf(doc: Doc, s: Schema, known: Record<string, string[]> = {}): fc.Arbitrary<unknown> {
  s = deref(doc, s);
  if (s.const !== undefined) return fc.constant(s.const);
  if (Array.isArray(s.enum)) return fc.constantFrom(...s.enum);
  const union = (s.anyOf ?? s.oneOf) as Schema[] | undefined;
  if (union) return fc.oneof(...union.map((u) => valueOf(doc, u, known)));
  switch (s.type) {
    case 'null':
      return fc.constant(null);
    case 'boolean':
      return fc.boolean();
    case 'integer': {
      const lo = (s.minimum as number | undefined) ?? -1000;
      const hi = (s.maximum as number | undefined) ?? 1_000_000;
      return hi > MAX_INT ? fc.oneof(fc.integer({ min: lo, max: MAX_INT }), fc.constant(hi)) : fc.integer({ min: lo, max: hi });
    }
    case 'number':
      return fc.double({ min: (s.minimum as number) ?? -1e6, max: (s.maximum as number) ?? 1e6, noNaN: true });
    case 'string':
      return stringOf(s, known);
    case 'array':
      return fc.array(valueOf(doc, (s.items as Schema) ?? {}, known), { maxLength: 3 });
    case 'object': {
      const props = (s.properties ?? {}) as Record<string, Schema>;
      const record = fc.record(Object.fromEntries(Object.entries(props).map(([k, p]) => [k, valueOf(doc, p, known)])), {
        requiredKeys: (s.required as string[] | undefined) ?? [],
      });
      const min = (s.minProperties as number | undefined) ?? 0;
      return min > 0 ? record.filter((o) => Object.keys(o).length >= min) : record;
    }
    default:
      return fc.jsonValue({ maxDepth: 2 });
  }
}

function stringOf(s: Schema, known: Record<string, string[]>): fc.Arbitrary<string> {
  const min = (s.minLength as number | undefined) ?? 0;
  const max = Math.min((s.maxLength as number | undefined) ?? 40, 300);
  const fits = (v: string) => v.length >= min && v.length <= max;
  if (s.format === 'date-time') return fc.date({ noInvalidDate: true }).map((d) => d.toISOString());
  if (typeof s.pattern === 'string') {
    const drawn = fc.stringMatching(new RegExp(s.pattern)).filter(fits);
    const seen = known[s.pattern];
    return seen?.length ? fc.oneof({ arbitrary: fc.constantFrom(...seen), weight: 3 }, drawn) : drawn;
  }
  return fc.string({ minLength: min, maxLength: max });
}

/** A value of another JSON type than `schema` allows (a string for an integer, an object for a string...). */
export function wrongTypeOf(doc: Doc, schema: Schema): fc.Arbitrary<unknown> {
  const s = deref(doc, schema);
  const types = new Set([s.type, ...((s.anyOf as Schema[] | undefined) ?? []).map((u) => deref(doc, u).type)]);
  if (types.has('integer')) types.add('number');
  const all: Array<[string, fc.Arbitrary<unknown>]> = [
    ['string', fc.string({ maxLength: 5 })],
    ['number', fc.double({ noNaN: true, noDefaultInfinity: true }).filter((n) => !Number.isInteger(n))],
    ['boolean', fc.boolean()],
    ['null', fc.constant(null)],
    ['array', fc.array(fc.integer(), { maxLength: 2 })],
    ['object', fc.dictionary(fc.string({ maxLength: 4 }), fc.integer(), { maxKeys: 2 })],
  ];
  return fc.oneof(...all.filter(([t]) => !types.has(t)).map(([, a]) => a));
}

/** Validators for the document's response schemas, compiled once each. */
export function responseChecker(doc: Doc) {
  const ajv = new Ajv2020({ strict: false, allErrors: false });
  addFormats.default(ajv);
  ajv.addSchema(doc as object, 'doc');
  const compiled = new Map<string, ValidateFunction>();
  const pointer = (...parts: string[]) => parts.map((p) => p.replace(/~/g, '~0').replace(/\//g, '~1')).join('/');
  return (path: string, method: string, status: string, type: string) => {
    const where = pointer('paths', path, method, 'responses', status, 'content', type, 'schema');
    let v = compiled.get(where);
    if (!v) {
      v = ajv.getSchema(`doc#/${where}`)!;
      compiled.set(where, v);
    }
    return v;
  };
}

/**
 * What is wrong with an answer to `method path` (an operation of `doc`, or none for a route it
 * does not have): a 5xx other than a documented 503, no answer or an empty body, a framework's
 * own error shape, a documented status whose body breaks its schema, or an undocumented one not
 * in the Error shape. Empty when the answer keeps the contract.
 */
export function contractProblems(
  doc: Doc,
  check: ReturnType<typeof responseChecker>,
  at: { path: string; method: string } | undefined,
  req: RawRequest,
  res: RawAnswer,
): string[] {
  const op = at ? doc.paths[at.path]?.[at.method] : undefined;
  const documented = op?.responses ?? {};
  if (res.late) return [`no answer within ${res.late} ms (status ${res.status || 'none'})`];
  if (!res.status) return ['no answer (connection closed without a status line)'];
  const problems: string[] = [];
  if (res.status >= 500 && !(res.status === 503 && documented['503'])) problems.push(`status ${res.status}`);
  if (req.method === 'HEAD' || res.status === 204 || res.status === 304) return problems;
  if (res.body === '') return [...problems, `status ${res.status} with an empty body`];
  const type = (res.headers['content-type']?.[0] ?? '').split(';')[0]!.trim();
  let body: unknown;
  if (type === 'application/json') {
    try {
      body = JSON.parse(res.body);
    } catch {
      return [...problems, `status ${res.status}: application/json that does not parse`];
    }
  }
  const fields = body && typeof body === 'object' ? Object.keys(body) : [];
  if (fields.includes('statusCode') || fields.includes('error')) problems.push(`a framework-shaped body: ${res.body.slice(0, 200)}`);
  const answer = documented[String(res.status)];
  if (at && answer?.content?.[type]) {
    if (type !== 'application/json') return problems;
    const valid = check(at.path, at.method, String(res.status), type);
    if (!valid(body))
      problems.push(`status ${res.status} breaks its schema: ${JSON.stringify(valid.errors?.[0])}: ${res.body.slice(0, 300)}`);
    return problems;
  }
  const error = body as { code?: unknown; message?: unknown; status?: unknown } | undefined;
  const isError =
    fields.length === 3 && typeof error?.code === 'string' && typeof error.message === 'string' && error.status === res.status;
  if (!isError) problems.push(`status ${res.status} is not documented and not an Error {code, message, status}: ${res.body.slice(0, 300)}`);
  return problems;
}

/** Every operation of the document: its path template and method. */
export function operations(doc: Doc): Array<{ path: string; method: string; op: Operation }> {
  return Object.entries(doc.paths).flatMap(([path, ops]) => Object.entries(ops).map(([method, op]) => ({ path, method, op })));
}

/** The path with its `{name}` parameters filled in (percent-encoded). */
export const fillPath = (template: string, values: Record<string, string>) =>
  template.replace(/\{([^}]+)\}/g, (_, name: string) => encodeURIComponent(values[name] ?? ''));
