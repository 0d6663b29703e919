import { once } from 'node:events';
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';

import { text } from 'node:stream/consumers';
import { type Static, type TSchema, Type } from '@sinclair/typebox';
import { Ajv2020, type ValidateFunction } from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';

import { listening } from './net.js';
import type { Fault } from './sink.js';

// Stripe's and Lago's documented rules on real HTTP servers. The request bodies are checked by
// ajv against schemas written from the vendors' reference (Stripe: the `stripe` npm package's
// V2.Billing.MeterEventStreamCreateParams; Lago: `POST /api/v1/events/batch`), not by our code.

const ajv = new Ajv2020({ strict: false, allErrors: true });
addFormats.default(ajv);
const compile = <T extends TSchema>(schema: T) => ajv.compile<Static<T>>(schema);

/** stripe (npm) types/V2/Billing/MeterEventStreamResource.d.ts: up to 100 events a request; the identifier at most 100 characters. */
const StripeStream = Type.Object({
  events: Type.Array(
    Type.Object(
      {
        event_name: Type.String({ minLength: 1, maxLength: 100 }),
        identifier: Type.String({ minLength: 1, maxLength: 100 }),
        payload: Type.Object(
          { stripe_customer_id: Type.String({ minLength: 1 }), value: Type.String({ pattern: '^-?\\d+$' }) },
          { additionalProperties: Type.String() },
        ),
        timestamp: Type.String({ format: 'date-time' }),
      },
      { additionalProperties: false },
    ),
    { minItems: 1, maxItems: 100 },
  ),
});

/** Lago's batch: at most 100 events; `timestamp` in Unix seconds. */
const LagoBatch = Type.Object({
  events: Type.Array(
    Type.Object(
      {
        transaction_id: Type.String({ minLength: 1 }),
        external_subscription_id: Type.String({ minLength: 1 }),
        code: Type.String({ minLength: 1 }),
        timestamp: Type.Integer({ minimum: 0 }),
        properties: Type.Object({ units: Type.Integer() }),
      },
      { additionalProperties: false },
    ),
    { minItems: 1 },
  ),
});

const DAY_MS = 24 * 3600 * 1000;

export interface Double<E> {
  url: string;
  /** Each event kept, by its id, once. */
  kept: Map<string, E>;
  /** SUM of the value by customer (Stripe) or subscription (Lago): the meter. */
  meter: Map<string, number>;
  state: {
    posts: number;
    /** Events in each POST, in order. */
    sizes: number[];
    /** Bodies refused by the schema, with why. */
    invalid: string[];
    /** POSTs refused for an id already kept. */
    duplicates: number;
    /** The events those refused POSTs carried that it held already: redeliveries (Stripe names one of them, Lago each). */
    duplicateEvents: number;
    /** Keep the next POSTs' events (Lago: `keepHalf`, the first half) and answer 503: a biller that stored, then timed out. */
    failAfterKeeping: number;
    keepHalf: boolean;
    /** Answer the next POST this (e.g. 429) without keeping anything. */
    answer?: { status: number; headers?: Record<string, string> };
    /** Awaited before a POST is read: a biller holding its answers. */
    gate?: Promise<void>;
    /** Asked for each valid POST: the fault to play on it (sink.ts's Fault), if any. */
    fault?: () => Fault | undefined;
    /** POSTs a `hold` keeps unanswered now. */
    holding: number;
    /** When each POST arrived (ms). */
    times: number[];
    /** Each POST's `stripe-version` header (undefined: none), as Node reads it (two would be joined). */
    versions: Array<string | string[] | undefined>;
  };
  /** Stripe's meter event sessions, when the double was started with a secret key. */
  sessions?: Sessions;
}

/** Stripe's `POST /v2/billing/meter_event_session` and the tokens it gave, each valid `lifetimeMs`. */
export interface Sessions {
  /** The secret key it takes (Bearer): set another to refuse the gateway's, as Stripe does a revoked key. */
  secret: string;
  lifetimeMs: number;
  /** Token → when it expires (ms). */
  tokens: Map<string, number>;
  /** Sessions made, with when. */
  made: number[];
  /** Session requests refused for a wrong key, with when. */
  refusedKeys: number[];
  /** Stream POSTs refused for an unknown or expired token. */
  refusedTokens: number;
  /** Revoke the token the next stream POST carries, before reading it: a token Stripe stopped taking early. */
  revokeNext: boolean;
  /** Refuse every token while set, naming it in the message (none of Stripe's messages do): a log must not carry it. */
  refuseAll: boolean;
  /** Each session request's `stripe-version` header. */
  versions: Array<string | string[] | undefined>;
}

async function serve<E>(
  path: string,
  handle: (body: unknown, d: Double<E>, res: ServerResponse) => void,
  validate: ValidateFunction,
  sessions?: Sessions,
): Promise<Double<E>> {
  const d: Double<E> = {
    ...(sessions && { sessions }),
    url: '',
    kept: new Map(),
    meter: new Map(),
    state: {
      posts: 0,
      sizes: [],
      invalid: [],
      duplicates: 0,
      duplicateEvents: 0,
      failAfterKeeping: 0,
      keepHalf: false,
      holding: 0,
      times: [],
      versions: [],
    },
  };
  const server = createServer(async (req: IncomingMessage, res) => {
    if (d.sessions && req.url === SESSION_PATH) return void session(d.sessions, req, res);
    d.state.times.push(Date.now());
    d.state.versions.push(req.headers['stripe-version']);
    await d.state.gate;
    const body = await text(req);
    d.state.posts++;
    if (d.sessions && !authorized(d.sessions, req, res)) return;
    if (req.method !== 'POST' || req.url !== path || req.headers['content-type'] !== 'application/json')
      return void res.writeHead(404).end();
    const answer = d.state.answer;
    d.state.answer = undefined;
    if (answer) return void res.writeHead(answer.status, answer.headers).end();
    let parsed: unknown;
    try {
      parsed = JSON.parse(body);
    } catch {
      d.state.invalid.push('not JSON');
      return void res.writeHead(400).end();
    }
    d.state.sizes.push(Array.isArray((parsed as { events?: unknown }).events) ? (parsed as { events: unknown[] }).events.length : -1);
    if (!validate(parsed)) {
      d.state.invalid.push(ajv.errorsText(validate.errors));
      return void json(res, path.includes('v2') ? 400 : 422, {
        error: { type: 'invalid_request_error', message: ajv.errorsText(validate.errors) },
        ...(!path.includes('v2') && { status: 422, code: 'validation_errors', error_details: { events: ['invalid'] } }),
      });
    }
    const fault = d.state.fault?.();
    if (fault === 'fail') return void res.writeHead(503).end();
    if (fault === 'drop') return void res.socket?.destroy();
    if (fault === 'hold') {
      d.state.holding++;
      // Its client may have closed it already (then no 'close' is left to wait for).
      if (res.socket && !res.socket.destroyed) await once(res, 'close');
      d.state.holding--;
    }
    if (!fault) return handle(parsed, d, res);
    // The biller's rules run as always; its answer goes nowhere.
    handle(parsed, d, UNHEARD);
    res.socket?.destroy();
  });
  const base = await listening(server);
  d.url = `${base}${path}`;
  return d;
}

/** A response that nobody receives: a biller's answer lost on its way. */
const UNHEARD = { writeHead: () => ({ end: () => undefined }) } as unknown as ServerResponse;

const json = (res: ServerResponse, status: number, body: unknown) =>
  void res.writeHead(status, { 'content-type': 'application/json' }).end(JSON.stringify(body));

/** Keeps the events, or (failAfterKeeping) keeps them and answers 503. */
function keep<E>(d: Double<E>, res: ServerResponse, list: E[], id: (e: E) => string, meter: (e: E) => [string, number]) {
  const taken = d.state.failAfterKeeping > 0 && d.state.keepHalf ? list.slice(0, Math.ceil(list.length / 2)) : list;
  for (const e of taken) {
    d.kept.set(id(e), e);
    const [who, v] = meter(e);
    d.meter.set(who, (d.meter.get(who) ?? 0) + v);
  }
  if (d.state.failAfterKeeping > 0) {
    d.state.failAfterKeeping--;
    return void res.writeHead(503).end();
  }
  json(res, 200, {});
}

const SESSION_PATH = '/v2/billing/meter_event_session';
let tokenSeq = 0;

/**
 * A session for the secret key (Bearer), else 401 as Stripe answers a wrong key (it masks the
 * key in its message): `{id, object, authentication_token, created, expires_at, livemode}`.
 */
async function session(s: Sessions, req: IncomingMessage, res: ServerResponse): Promise<void> {
  await text(req);
  s.versions.push(req.headers['stripe-version']);
  if (req.method !== 'POST') return void res.writeHead(405).end();
  const now = Date.now();
  if (req.headers.authorization !== `Bearer ${s.secret}`) {
    s.refusedKeys.push(now);
    return json(res, 401, { error: { type: 'invalid_request_error', message: 'Invalid API Key provided: sk_test_****' } });
  }
  const token = `mes_tok_${process.pid}_${++tokenSeq}_${Math.random().toString(36).slice(2)}`;
  s.tokens.set(token, now + s.lifetimeMs);
  s.made.push(now);
  json(res, 200, {
    id: `mes_${tokenSeq}`,
    object: 'v2.billing.meter_event_session',
    authentication_token: token,
    created: new Date(now).toISOString(),
    expires_at: new Date(now + s.lifetimeMs).toISOString(),
    livemode: false,
  });
}

/** The stream takes a live session's token only: an unknown or expired one is a 401, as Stripe's. */
function authorized(s: Sessions, req: IncomingMessage, res: ServerResponse): boolean {
  const token = /^Bearer (.+)$/.exec(req.headers.authorization ?? '')?.[1];
  if (s.refuseAll) {
    s.refusedTokens++;
    json(res, 401, { error: { type: 'invalid_request_error', code: 'invalid_token', message: `Token ${token} is not valid.` } });
    return false;
  }
  if (s.revokeNext && token !== undefined) {
    s.tokens.delete(token);
    s.revokeNext = false;
  }
  const expires = token === undefined ? undefined : s.tokens.get(token);
  if (expires !== undefined && Date.now() < expires) return true;
  s.refusedTokens++;
  json(res, 401, {
    error:
      expires === undefined
        ? { type: 'invalid_request_error', code: 'invalid_token', message: 'The provided authentication token is not valid.' }
        : { type: 'invalid_request_error', code: 'billing_meter_event_session_expired', message: 'The meter event session has expired.' },
  });
  return false;
}

export type StripeEvent = Static<typeof StripeStream>['events'][number];

/**
 * Stripe's v2 meter event stream: a request is refused whole (400, its `error.message`) for an
 * unknown customer, a timestamp outside the past 35 days (or over 5 minutes ahead), or an
 * identifier it holds: `An event already exists with identifier <id>.`. A SUM meter by customer.
 * With `auth`, the stream takes a meter event session's token, made at `/v2/billing/meter_event_session`.
 */
export function startStripe(
  customers: readonly string[],
  /** Stripe's meter event sessions in front of the stream: the secret key they take, and each token's life. */
  auth?: { secret: string; lifetimeMs: number },
  /** Stripe's clock, for its timestamp window: a test's deployment may run on a shifted one (shifted-clock.ts). */
  clock: () => number = Date.now,
): Promise<Double<StripeEvent>> {
  const known = new Set(customers);
  const refuse = (res: ServerResponse, message: string) => json(res, 400, { error: { type: 'invalid_request_error', message } });
  return serve<StripeEvent>(
    '/v2/billing/meter_event_stream',
    (body, d, res) => {
      const list = (body as Static<typeof StripeStream>).events;
      const now = clock();
      const seen = new Set<string>();
      for (const e of list) {
        if (!known.has(e.payload.stripe_customer_id)) return refuse(res, `No such customer: '${e.payload.stripe_customer_id}'`);
        const at = Date.parse(e.timestamp);
        if (at < now - 35 * DAY_MS || at > now + 5 * 60_000) return refuse(res, 'Timestamp must be within the past 35 days');
        if (d.kept.has(e.identifier) || seen.has(e.identifier)) {
          d.state.duplicates++;
          d.state.duplicateEvents += list.filter((x) => d.kept.has(x.identifier)).length;
          return refuse(res, `An event already exists with identifier ${e.identifier}.`);
        }
        seen.add(e.identifier);
      }
      keep(
        d,
        res,
        list,
        (e) => e.identifier,
        (e) => [e.payload.stripe_customer_id, Number(e.payload.value)],
      );
    },
    compile(StripeStream),
    auth && { ...auth, tokens: new Map(), made: [], refusedKeys: [], refusedTokens: 0, revokeNext: false, refuseAll: false, versions: [] },
  );
}

export type LagoEvent = Static<typeof LagoBatch>['events'][number];

/**
 * Lago's `/api/v1/events/batch`: over 100 events is a 422 (`too_many_events`); a transaction_id
 * it holds (or twice in the batch) refuses the whole batch with 422, `error_details` by position
 * (getlago/lago-api#3049). A SUM meter of `properties.units` by subscription.
 */
export function startLago(): Promise<Double<LagoEvent>> {
  return serve<LagoEvent>(
    '/api/v1/events/batch',
    (body, d, res) => {
      const list = (body as Static<typeof LagoBatch>).events;
      const unprocessable = (details: unknown) =>
        json(res, 422, { status: 422, error: 'Unprocessable Entity', code: 'validation_errors', error_details: details });
      if (list.length > 100) return unprocessable({ events: ['too_many_events'] });
      const details: Record<string, unknown> = {};
      const seen = new Set<string>();
      list.forEach((e, i) => {
        if (d.kept.has(e.transaction_id) || seen.has(e.transaction_id)) details[i] = { transaction_id: ['value_already_exist'] };
        seen.add(e.transaction_id);
      });
      if (Object.keys(details).length > 0) {
        d.state.duplicates++;
        d.state.duplicateEvents += Object.keys(details).length;
        return unprocessable(details);
      }
      keep(
        d,
        res,
        list,
        (e) => e.transaction_id,
        (e) => [e.external_subscription_id, e.properties.units],
      );
    },
    compile(LagoBatch),
  );
}
