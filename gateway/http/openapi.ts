import type { GatewayConfig } from '../config/config.js';
import type { Deprecation } from '../deprecation.js';
import { ErrorBody, GatewayError } from '../errors.js';
import { UsageView } from '../quota/usage-view.js';
import { DOCUMENT_ROUTE, ROUTES, type RouteId, STATEMENT_ROUTE, USAGE_ROUTE } from '../routes.js';
import { StatementSchema } from '../usage/statements.js';

// The API's OpenAPI document as clients see it through the gateway, served to anyone at
// GET /v1/openapi.json (it counts against the per-address limit). The backend's document stays
// the single source of truth for operations, parameters and shapes (named, under
// components/schemas); this adds what the gateway does: only the operations it proxies, HEAD
// beside each GET, the bearer scheme, 401/429/502/503/504 and a default with the Error body on
// every operation, the headers each answer carries (errors.ts, quota/headers.ts, quota/admit.ts),
// and from the config the deprecated operations' headers and their 410.

export const OPENAPI_PATH = DOCUMENT_ROUTE.path;

type Json = Record<string, unknown>;
interface Response {
  description: string;
  headers?: Record<string, Json>;
  content?: Json;
}
interface Operation {
  operationId?: string;
  deprecated?: boolean;
  responses?: Record<string, Response>;
  [field: string]: unknown;
}
export interface OpenApiDocument {
  openapi: string;
  info: { title: string; version: string; description?: string; [field: string]: unknown };
  tags?: Array<{ name: string; description?: string }>;
  paths?: Record<string, Record<string, Operation>>;
  components?: { schemas?: Json; [part: string]: unknown };
  [field: string]: unknown;
}

const ref = (part: string, name: string) => ({ $ref: `#/components/${part}/${name}` });
const integer = { type: 'integer', minimum: 0 };
const text = { type: 'string' };

/** Every header the API documents (headers.ts and deprecation.ts write most); `required`: on every such answer. */
const HEADERS: Record<string, Json> = {
  'X-Request-Id': {
    required: true,
    description: "The request id: the client's when it is 1 to 128 of [A-Za-z0-9._:-], else a new UUID",
    schema: text,
  },
  'RateLimit-Policy': {
    required: true,
    description:
      "The key's windows (or the client address's without a key), IETF draft-ietf-httpapi-ratelimit-headers-10: minute, hour when the plan has one, day, and the billing period's month (w: its length in seconds) when the plan has one. With overage, q is the quota plus the overage",
    schema: text,
    example: '"minute";q=60;w=60, "day";q=1000;w=86400, "month";q=20000;w=2592000',
  },
  RateLimit: {
    required: true,
    description: "Each window's state: r requests left, t seconds until it resets",
    schema: text,
    example: '"minute";r=59;t=20, "day";r=999;t=76400',
  },
  'X-RateLimit-Limit': {
    required: true,
    description: 'Limit of the window nearest exhaustion (on a 429, the violated one)',
    schema: integer,
  },
  'X-RateLimit-Remaining': { required: true, description: 'Requests left in that window (0 during a ban)', schema: integer },
  'X-RateLimit-Reset': {
    required: true,
    description: 'Unix time (seconds) when that window resets, or when the ban ends',
    schema: integer,
  },
  'Retry-After': {
    required: true,
    description:
      'Whole seconds to wait: until the blocking window resets or the ban ends (429), 1 while the quota store is unavailable (503)',
    schema: { type: 'integer', minimum: 1 },
  },
  'Retry-After-Grant': {
    description: "Present only when the plan grants credits each period: whole seconds until the next grant (the period's start)",
    schema: { type: 'integer', minimum: 1 },
  },
  'X-Credits-Remaining': {
    description: 'Only for an account with prepaid credits: the units left after this request (granted plus purchased)',
    schema: integer,
  },
  'X-Quota-Overage': {
    description:
      "Only on a request admitted past the quota, within the plan's overage (billed extra): the units of the month (the day, without a month window) past the quota so far",
    schema: integer,
  },
  Allow: { description: 'On a 405 method_not_allowed: the methods the path serves', schema: text, example: 'GET, HEAD, POST' },
  'WWW-Authenticate': { required: true, description: 'Bearer', schema: text },
  Deprecation: {
    required: true,
    description: 'RFC 9745: when the operation was deprecated (@ Unix seconds)',
    schema: text,
    example: '@1735689600',
  },
  Sunset: { required: true, description: 'RFC 8594: when the operation stops answering (then 410 route_sunset)', schema: text },
  'Link-Deprecation': {
    required: true,
    description: 'The successor (rel="successor-version"), and the documentation when configured',
    schema: text,
  },
  'Link-Next': { description: 'While more remain: the next page, <...>; rel="next"', schema: text },
  Location: { required: true, description: "The new pet's URL", schema: text },
  'Idempotent-Replayed': {
    description: '"true" when the answer is the replay of an earlier request with the same Idempotency-Key',
    schema: text,
  },
};

const EVERY_ANSWER = ['X-Request-Id', 'RateLimit-Policy', 'RateLimit', 'X-RateLimit-Limit', 'X-RateLimit-Remaining', 'X-RateLimit-Reset'];
/** Failing closed, the quota store's 503 knows the policy but not the windows' state (quota/admit.ts). */
const STORE_UNAVAILABLE = ['X-Request-Id', 'RateLimit-Policy', 'Retry-After'];
/** Headers of a request counted against a key with credits or overage, beyond EVERY_ANSWER: never on a 401, which has no key. */
const BILLING_HEADERS = ['X-Credits-Remaining', 'X-Quota-Overage'];
/** Headers of one status beyond EVERY_ANSWER, whatever the operation. */
const STATUS_HEADERS: Record<string, string[]> = { '401': ['WWW-Authenticate'], '429': ['Retry-After'], default: ['Allow'] };

/** Headers the backend adds to one operation's answers, by status. */
const BACKEND_HEADERS: Partial<Record<RouteId, Record<string, Record<string, string>>>> = {
  listPets: { '200': { Link: 'Link-Next' } },
  listOrders: { '200': { Link: 'Link-Next' } },
  createPet: { '201': { Location: 'Location', 'Idempotent-Replayed': 'Idempotent-Replayed' } },
};

const DESCRIPTIONS: Record<string, string> = {
  '200': 'OK',
  '201': 'Created',
  '400':
    "The request breaks the schema: validation_failed, malformed_json, invalid_cursor, invalid_idempotency_key, or the gateway's bad_request / invalid_path",
  '401': 'unauthorized: the key is missing, malformed, unknown, revoked or of the other environment',
  '402': "credits_exhausted: the account's prepaid credits do not cover the request; Retry-After only when a grant is due",
  '404': 'Not found',
  '410': 'route_sunset: the operation is past its Sunset date',
  '413': 'payload_too_large: the body is larger than the limit',
  '414': 'uri_too_long: a path segment is longer than the service accepts',
  '415': 'unsupported_media_type: the body is not application/json',
  '422': 'idempotency_key_reused: the same Idempotency-Key with another body',
  '429':
    'rate_limited (the minute is used up), hourly_quota_exceeded (the hour, a plan with perHour), daily_quota_exceeded (the day), monthly_quota_exceeded (the billing period), or key_banned (the key kept sending after 429s)',
  '502': 'bad_gateway: the backend could not be reached',
  '503':
    'quota_store_unavailable: the quota store is not answering and the gateway is set to fail closed (QUOTA_STORE_FAILURE=closed), or the account has prepaid credits or a month window it cannot decide without it; retry after Retry-After',
  '504': 'gateway_timeout: the backend did not answer in time',
  default:
    'Another error, in the Error shape: 405 method_not_allowed (with Allow), 408 request_timeout, 413 payload_too_large, 417 expectation_failed, 431 headers_too_large, 500 internal_error',
};

/** An error answer: the Error body, and the headers this status carries on every operation. */
function errorResponse(status: string): Response {
  const names = status === '503' ? STORE_UNAVAILABLE : [...EVERY_ANSWER, ...(STATUS_HEADERS[status] ?? [])];
  const headers = Object.fromEntries(names.map((name) => [name, ref('headers', name)]));
  if (status !== '401' && status !== '503' && status !== 'default') headers['X-Credits-Remaining'] = ref('headers', 'X-Credits-Remaining');
  if (status === '402') headers['Retry-After'] = ref('headers', 'Retry-After-Grant');
  return {
    description: DESCRIPTIONS[status] ?? 'Error',
    headers,
    content: { 'application/json': { schema: ref('schemas', 'Error') } },
  };
}

/** The errors the gateway itself may answer on any operation, beyond the backend's. */
const GATEWAY_ANSWERS = ['401', '402', '429', '502', '503', '504', 'default'];

/** One operation as the gateway serves it: the backend's, with the gateway's answers and headers. */
function throughGateway(op: Operation, id: RouteId, deprecation: Deprecation | undefined): Operation {
  const responses: Record<string, Response> = {};
  for (const [status, r] of Object.entries(op.responses ?? {})) {
    if (Number(status) >= 400) {
      responses[status] = errorResponse(status);
      continue;
    }
    const description = r.description === 'Default Response' ? (DESCRIPTIONS[status] ?? r.description) : r.description;
    const headers = Object.fromEntries([...EVERY_ANSWER, ...BILLING_HEADERS].map((name) => [name, ref('headers', name)]));
    for (const [name, component] of Object.entries(BACKEND_HEADERS[id]?.[status] ?? {})) headers[name] = ref('headers', component);
    responses[status] = { ...r, description, headers };
  }
  for (const status of GATEWAY_ANSWERS) responses[status] = errorResponse(status);
  if (deprecation) responses['410'] = errorResponse('410');
  for (const [status, r] of Object.entries(responses)) {
    // Set once a request with a valid key has its route: not on a 401 (it says nothing of routes)
    // nor on the rare answers the default covers (a 405 has no route; a 417 or 431 never reaches routing).
    if (deprecation && status !== '401' && status !== 'default') {
      r.headers!.Deprecation = ref('headers', 'Deprecation');
      r.headers!.Sunset = ref('headers', 'Sunset');
      r.headers!.Link ??= ref('headers', 'Link-Deprecation');
    }
  }
  return { ...op, ...(deprecation ? { deprecated: true } : {}), responses: Object.fromEntries(Object.entries(responses).sort()) };
}

/** HEAD, which the gateway answers wherever it answers GET: the same answers and headers, no body. */
function headOf(get: Operation): Operation {
  const responses: Record<string, Response> = {};
  for (const [status, { description, headers }] of Object.entries(get.responses ?? {})) responses[status] = { description, headers };
  return {
    ...get,
    operationId: `${get.operationId}Head`,
    summary: `${String(get.summary)}: headers only`,
    description: `As GET, without the body. ${String(get.description ?? '')}`.trim(),
    responses,
  };
}

/** GET /v1/me/usage: the key's own quota, counted per client address so that it answers past the key's limit. */
function usageOperation(): Operation {
  const responses: Record<string, Response> = {
    '200': {
      description: "The key's account's windows, ban and recent 429s",
      headers: Object.fromEntries(EVERY_ANSWER.map((name) => [name, ref('headers', name)])),
      content: { 'application/json': { schema: ref('schemas', 'Usage') } },
    },
  };
  for (const status of ['401', '429', '503', 'default']) responses[status] = errorResponse(status);
  return {
    operationId: 'getMyUsage',
    tags: ['usage'],
    summary: "This key's usage",
    description:
      "The quota of the key's account as the gateway enforces it. It costs the key nothing: it counts against the per-address limit for requests without a key, so it answers even when the key is over its limit or banned (the rate-limit headers are then the address's).",
    responses,
  };
}

/** GET /v1/me/statements/{period}: the account's usage statement, on the same per-address terms as the usage route. */
function statementOperation(): Operation {
  const responses: Record<string, Response> = {
    '200': {
      description: "The key's account's statement for the billing period: what the usage export delivered for it",
      headers: Object.fromEntries(EVERY_ANSWER.map((name) => [name, ref('headers', name)])),
      content: { 'application/json': { schema: ref('schemas', 'Statement') } },
    },
  };
  for (const status of ['400', '401', '409', '429', '503', 'default']) responses[status] = errorResponse(status);
  return {
    operationId: 'getMyStatement',
    tags: ['usage'],
    summary: "This key's account's usage statement for a billing period",
    description:
      'Lines per plan and route, refunds, credits and totals of the events the usage export delivered for the period, and their digest. `period`: current, previous, or a UTC date (YYYY-MM-DD) inside it. 409 statements_not_enabled when the gateway exports no usage. Counted as /v1/me/usage is.',
    parameters: [
      {
        name: 'period',
        in: 'path',
        required: true,
        schema: { type: 'string', pattern: '^(current|previous|\\d{4}-\\d{2}-\\d{2})$' },
        description: 'current, previous, or a UTC date inside the period',
      },
    ],
    responses,
  };
}

/** The document operation itself: public, limited per client address. */
function documentOperation(): Operation {
  const responses: Record<string, Response> = {
    '200': {
      description: 'This document',
      headers: Object.fromEntries(EVERY_ANSWER.map((name) => [name, ref('headers', name)])),
      content: { 'application/json': { schema: { type: 'object' } } },
    },
  };
  for (const status of ['429', '502', '503', '504', 'default']) responses[status] = errorResponse(status);
  return {
    operationId: 'getOpenApiDocument',
    tags: ['document'],
    summary: 'This OpenAPI document',
    description: 'Public: no key needed. It counts against the per-address limit for requests without a key.',
    security: [],
    responses,
  };
}

const DESCRIPTION = [
  'The Pet Store API, served by its gateway. Every operation but this document needs `Authorization: Bearer <API key>`.',
  'Every answer carries X-Request-Id. Every answer but a 503 also carries the rate-limit headers (RateLimit-Policy, RateLimit,',
  "X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset) of the quota it was counted against: the key's, or without a",
  "valid key the client address's. A 429 adds Retry-After; a key that keeps sending after 429s is banned for a while (key_banned).",
  "A plan may add a billing period (a month from the account's billing day: 429 monthly_quota_exceeded), overage (admitted past",
  'the quota, marked by X-Quota-Overage) and prepaid credits (X-Credits-Remaining; 402 credits_exhausted when they run out).',
  'A gateway set to fail closed (QUOTA_STORE_FAILURE=closed), or an account with credits, answers 503 quota_store_unavailable while its quota store does not',
  'answer, with only X-Request-Id, RateLimit-Policy and Retry-After.',
].join(' ');

/** The gateway's document from the backend's: pure, so a test can check it against the running service. */
export function gatewayDocument(backend: OpenApiDocument, deprecations: ReadonlyMap<RouteId, Deprecation>): OpenApiDocument {
  const paths: Record<string, Record<string, Operation>> = {};
  for (const route of ROUTES) {
    const op = backend.paths?.[route.path]?.[route.method.toLowerCase()];
    if (!op) continue; // not served by the backend: not documented
    const path = (paths[route.path] ??= {});
    path[route.method.toLowerCase()] = throughGateway(op, route.id, deprecations.get(route.id));
    if (route.method === 'GET') path.head = headOf(path.get!);
  }
  const document = documentOperation();
  paths[OPENAPI_PATH] = { get: document, head: headOf(document) };
  const usage = usageOperation();
  paths[USAGE_ROUTE.path] = { get: usage, head: headOf(usage) };
  const statement = statementOperation();
  paths[STATEMENT_ROUTE.path] = { get: statement, head: headOf(statement) };
  const used = new Set(Object.values(paths).flatMap((ops) => Object.values(ops).flatMap((op) => (op.tags as string[] | undefined) ?? [])));
  return {
    openapi: backend.openapi,
    info: {
      title: 'Pet Store API',
      version: backend.info.version,
      description: DESCRIPTION,
      contact: { name: 'Pet Store API team' },
      // package.json is private and names no license: the API is proprietary.
      license: { name: 'Proprietary', identifier: 'LicenseRef-Proprietary' },
    },
    servers: [{ url: '/' }],
    security: [{ apiKey: [] }],
    tags: [
      ...(backend.tags ?? []).filter((t) => used.has(t.name)),
      { name: 'usage', description: "A key's own quota, as the gateway holds it" },
      { name: 'document', description: 'This OpenAPI document: public, no key needed' },
    ],
    paths,
    components: {
      ...backend.components,
      schemas: { ...backend.components?.schemas, Error: ErrorBody, Usage: UsageView, Statement: StatementSchema },
      securitySchemes: {
        apiKey: { type: 'http', scheme: 'bearer', description: 'An API key: psk_live_… (production) or psk_test_… (staging)' },
      },
      headers: HEADERS,
    },
  };
}

/**
 * Serves the document: the backend's is read once (again after a failure) and the gateway's is
 * made once per config, since the deprecations come from it.
 */
export function documentServer(backendUrl: string, timeoutMs: number) {
  let backend: Promise<OpenApiDocument> | undefined;
  const made = new WeakMap<GatewayConfig, OpenApiDocument>();

  async function fetchBackend(): Promise<OpenApiDocument> {
    let res: globalThis.Response;
    try {
      res = await fetch(new URL(OPENAPI_PATH, backendUrl), { signal: AbortSignal.timeout(timeoutMs) });
    } catch (err) {
      if ((err as Error).name === 'TimeoutError') throw new GatewayError('gateway_timeout', 'The backend did not answer in time');
      throw new GatewayError('bad_gateway', 'The backend could not be reached');
    }
    if (!res.ok) throw new GatewayError('bad_gateway', `The backend answered ${res.status} for its API document`);
    return (await res.json()) as OpenApiDocument;
  }

  return async function document(config: GatewayConfig): Promise<OpenApiDocument> {
    const cached = made.get(config);
    if (cached) return cached;
    backend ??= fetchBackend().catch((err: unknown) => {
      backend = undefined;
      throw err;
    });
    const doc = gatewayDocument(await backend, config.deprecations);
    made.set(config, doc);
    return doc;
  };
}
