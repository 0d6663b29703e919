import type { Span } from '@opentelemetry/api';
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import type { AccessEntry, AccessOutcome } from '../observability/access-log.js';
import { authenticate, isUnknownKey, type KeyLookup } from '../auth/authenticate.js';
import type { Consumer, GatewayConfig } from '../config/config.js';
import { corsHeaders, preflight } from './cors.js';
import { rawHeaders } from './reply-headers.js';
import { type Deprecation, sunsetRefusal } from '../deprecation.js';
import { GatewayError, handleError } from '../errors.js';
import { type Admission, admit } from '../quota/admit.js';
import type { Decision, EventTag, QuotaSubject } from '../quota/decision.js';
import type { RequestPath } from '../quota/store.js';
import { SlotHold } from './in-flight.js';
import {
  DOCUMENT_ROUTE,
  isDocumentPath,
  isPortalPath,
  isStatementPath,
  isUsagePath,
  matchRoute,
  PORTAL_ROUTE,
  type RouteId,
  STATEMENT_ROUTE,
  USAGE_ROUTE,
} from '../routes.js';

declare module 'fastify' {
  interface FastifyRequest {
    ctx: RequestContext;
  }
}

/** What the gateway learned about a request, step by step; read by the proxy and the access line. */
export interface RequestContext {
  /** The config in force when the request arrived: a reload mid-request does not change it. */
  readonly config: GatewayConfig;
  consumer?: Consumer;
  route?: RouteId;
  /** The quota decision, once made; "unauthenticated" for a request without a valid key that its address's quota let through. */
  outcome?: AccessOutcome;
  /** When the key's quota counted this request, if it did: a 502/504 gives it back. */
  countedAtMs?: number;
  /** Units this request cost its key (its route's cost; 1 by default). */
  cost?: number;
  /** Set when it was admitted past its quota, within the plan's overage: the overage window's units past the quota. */
  overage?: number;
  /** Its usage event (a key whose usage is exported): the response's status is joined to it. */
  eventId?: string;
  /** When the request left for the backend (performance.now()), for the upstream latency. */
  sentAt?: number;
  /** How long its admission waited on Redis (ms), and whether a lease answered it: for its trace. */
  redisMs?: number;
  leased?: boolean;
  /** Its trace span, while tracing is on (observability/tracing.ts). */
  span?: Span;
  /** Its concurrency slot, for a key with a concurrency limit: released once the answer and the backend call are over. */
  hold?: SlotHold;
  /** Its quota decision (Admission.decision), for the portal's history. */
  decision?: Decision;
}

/**
 * Starts a request's context; the request id goes on every answer, errors included. Every
 * field is there from the start, in one order, so that every context has the same shape and
 * V8's property lookups on it stay monomorphic.
 */
function begin(request: FastifyRequest, reply: FastifyReply, config: GatewayConfig): RequestContext {
  reply.raw.setHeader('x-request-id', request.id);
  request.ctx = {
    config,
    consumer: undefined,
    route: undefined,
    outcome: undefined,
    countedAtMs: undefined,
    cost: undefined,
    overage: undefined,
    eventId: undefined,
    sentAt: undefined,
    redisMs: undefined,
    leased: undefined,
    span: undefined,
    hold: undefined,
    decision: undefined,
  };
  return request.ctx;
}

/**
 * What makes a request ambiguous before anything is decided: HTTP/1.1 without Host (RFC 9112
 * §3.2; Node is told not to check, so the refusal is ours, in the Error shape), and a second
 * Authorization (a singleton field, RFC 9110 §11.6.2: Node would keep the first silently).
 */
function malformed(request: FastifyRequest): GatewayError | undefined {
  if (request.headers.host === undefined && request.raw.httpVersion === '1.1') {
    return new GatewayError('bad_request', 'HTTP/1.1 requests need a Host header');
  }
  if (request.headers.authorization !== undefined && authorizationFields(request.raw.rawHeaders) > 1) {
    return new GatewayError('bad_request', 'Authorization appears more than once');
  }
  return undefined;
}

function authorizationFields(raw: string[]): number {
  let n = 0;
  for (let i = 0; i < raw.length; i += 2) {
    // The usual spellings first: toLowerCase makes a new string each time.
    const name = raw[i]!;
    if (name === 'Authorization' || name === 'authorization' || (name.length === 13 && name.toLowerCase() === 'authorization')) n++;
  }
  return n;
}

/** What a key's usage event says of its request: only built when its usage is exported. */
function eventTag(request: FastifyRequest): EventTag {
  const { consumer, route } = request.ctx;
  return {
    requestId: request.id,
    keyId: consumer!.id,
    plan: consumer!.plan,
    route: route ?? 'none',
    method: request.method,
    eventId: undefined,
  };
}

/**
 * Admission's headers on the reply, its outcome and its usage event's id (the tag's:
 * EventTag.eventId) in the context, its concurrency slot held until the request is over at
 * both ends (in-flight.ts); returns the refusal.
 */
function applied(
  store: RequestPath,
  request: FastifyRequest,
  reply: FastifyReply,
  subject: QuotaSubject,
  admission: Admission,
  tag?: EventTag,
): GatewayError | undefined {
  rawHeaders(reply, admission.headers);
  const { ctx } = request;
  ctx.outcome = admission.outcome;
  ctx.countedAtMs = admission.countedAtMs;
  ctx.overage = admission.overage;
  ctx.eventId = tag?.eventId;
  ctx.redisMs = admission.redisMs;
  ctx.leased = admission.leased;
  ctx.decision = admission.decision;
  const slot = admission.slot;
  if (slot !== undefined) {
    const hold = (ctx.hold = new SlotHold(() => store.release(subject, slot)));
    // A client gone before its admission came back ('close' has been and will not come again):
    // its slot back at once, and no backend call that would run without one.
    if (reply.raw.closed) {
      hold.answered();
      return new GatewayError('bad_request', 'The client closed the connection before the request was admitted');
    }
    reply.raw.once('close', () => hold.answered());
  }
  return admission.refusal;
}

/**
 * Admission for this request, applied; returns the refusal. Without a promise when the store
 * decided without I/O (a lease, a known ban), so that most requests pass the hook in one step.
 */
function admitRequest(
  store: RequestPath,
  request: FastifyRequest,
  reply: FastifyReply,
  subject: QuotaSubject,
  cost = 1,
): GatewayError | undefined | Promise<GatewayError | undefined> {
  const tag = subject.events > 0 ? eventTag(request) : undefined;
  const admission = admit(store, subject, cost, tag);
  if (admission instanceof Promise) return admission.then((a) => applied(store, request, reply, subject, a, tag));
  return applied(store, request, reply, subject, admission, tag);
}

/** The per-address quota of a request without a key: throws its 429, or else `otherwise`. */
async function admitByAddress(store: RequestPath, request: FastifyRequest, reply: FastifyReply, otherwise?: GatewayError): Promise<void> {
  const refused = await admitRequest(store, request, reply, request.ctx.config.addressSubject(request.ip));
  if (refused) throw refused;
  if (otherwise) {
    // Not "allowed" on the access line: the address's quota let it through to its 401.
    if (otherwise.status === 401) request.ctx.outcome = 'unauthenticated';
    throw otherwise;
  }
}

/**
 * The gateway's own routes (the public document, a key's own usage): the per-address quota
 * instead of the key's, so a key over its limit or banned can still read why, and GET or HEAD only.
 */
async function ownRoute(store: RequestPath, request: FastifyRequest, reply: FastifyReply, route: RouteId): Promise<void> {
  request.ctx.route = route;
  await admitByAddress(store, request, reply);
  if (request.method !== 'GET' && request.method !== 'HEAD') {
    throw new GatewayError('method_not_allowed', `Method ${request.method} is not allowed here; use GET, HEAD`, { allow: 'GET, HEAD' });
  }
}

/** After the key's admission: its refusal, then the route's, then a sunset route's. */
function admitted(refused: GatewayError | undefined, route: ReturnType<typeof matchRoute>, deprecation: Deprecation | undefined): void {
  if (refused) throw refused;
  if (route instanceof GatewayError) throw route;
  const sunset = deprecation && sunsetRefusal(route, deprecation);
  if (sunset) throw sunset;
}

/** An error for fastify's `done`: given nothing, it would let the request through as if admitted. */
const failure = (err: unknown): Error => (err instanceof Error ? err : new Error(`request hook failed: ${String(err)}`));

/** The rest of the pipeline, once the key is known (or known to be no key). */
function authenticated(
  store: RequestPath,
  request: FastifyRequest,
  reply: FastifyReply,
  ctx: RequestContext,
  who: Consumer | GatewayError,
  unknownKey?: () => void,
): Promise<FastifyReply | void> | undefined {
  // A key the registry could not be asked about (503): Redis is not answering, and the address's
  // quota would wait on it a second time; a key refused (401) is counted against its address.
  if (who instanceof GatewayError && who.status === 503) throw who;
  if (who instanceof GatewayError) {
    if (unknownKey && isUnknownKey(who)) unknownKey();
    return admitByAddress(store, request, reply, who);
  }
  ctx.consumer = who;
  if (isUsagePath(request.url)) return ownRoute(store, request, reply, USAGE_ROUTE.id);
  if (isStatementPath(request.url)) return ownRoute(store, request, reply, STATEMENT_ROUTE.id);
  const route = matchRoute(request.method, request.url);
  const deprecation = route instanceof GatewayError ? undefined : ctx.config.deprecations.get(route.id);
  if (!(route instanceof GatewayError)) ctx.route = route.id;
  if (deprecation) rawHeaders(reply, deprecation.headers);
  // Every authenticated request counts (its route's cost), whatever its outcome, except one refused with 429.
  ctx.cost = (ctx.route && who.costs.get(ctx.route)) || 1;
  const refused = admitRequest(store, request, reply, who.subject, ctx.cost);
  if (refused instanceof Promise) return refused.then((r) => admitted(r, route, deprecation));
  admitted(refused, route, deprecation);
  return undefined;
}

/**
 * The request pipeline, in order: context, a CORS preflight, the public document (both on the
 * per-address quota), authentication (or the per-address quota), route, deprecation headers,
 * the key's quota (the route's cost), then the refusals. Every step that can refuse returns
 * its GatewayError; this is the one place that throws them.
 */
export function requestPipeline(
  store: RequestPath,
  config: () => GatewayConfig,
  record: (reqId: string, entry: AccessEntry) => void,
  keys?: KeyLookup,
  /** Told of each key refused as unknown: with KEY_STORE=file, whether a registry it does not read exists (auth/registry-unread.ts). */
  unknownKey?: () => void,
) {
  /** The pipeline itself: throws its refusal; a promise only where it waits (Redis, or the rarer paths). */
  function steps(request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply | void> | undefined {
    const ctx = begin(request, reply, config());
    if (ctx.config.corsOrigins.size > 0 && corsHeaders(request, reply, ctx.config.corsOrigins)) {
      // A browser's preflight: per-address quota, answered here, never proxied.
      return admitByAddress(store, request, reply).then(() => preflight(reply));
    }
    const bad = malformed(request);
    if (!bad && isDocumentPath(request.url)) return ownRoute(store, request, reply, DOCUMENT_ROUTE.id);
    // The portal signs in with its own session cookie, not a bearer key: per address, whatever it
    // carries, so a key over its limit can still see why (and sign-in guesses meet the address's limit).
    if (!bad && isPortalPath(request.url)) {
      ctx.route = PORTAL_ROUTE.id;
      return admitByAddress(store, request, reply);
    }
    // Authentication first, for every other path: a caller without a valid key learns nothing of routes.
    const who = bad ?? authenticate(request.headers.authorization, ctx.config, request.raw.socket, keys);
    if (who instanceof Promise) return who.then((found) => authenticated(store, request, reply, ctx, found, unknownKey));
    return authenticated(store, request, reply, ctx, who, unknownKey);
  }

  /**
   * fastify's onRequest hook, callback style: a request decided without waiting (most of them,
   * from a lease) passes without a promise or a microtask. A reply the pipeline sent itself (a
   * preflight) ends there: fastify goes no further with a sent reply.
   */
  function onRequest(request: FastifyRequest, reply: FastifyReply, done: (err?: Error) => void): void {
    let waiting: Promise<FastifyReply | void> | undefined;
    try {
      waiting = steps(request, reply);
    } catch (err) {
      done(failure(err));
      return;
    }
    if (waiting === undefined) done();
    else
      waiting.then(
        () => done(),
        (err: unknown) => done(failure(err)),
      );
  }

  /** fastify's frameworkErrors (a URL it cannot decode): no route, so no hooks; counted, answered and recorded here. */
  function onFrameworkError(err: FastifyError, request: FastifyRequest, reply: FastifyReply): void {
    const started = performance.now(); // fastify starts no reply timer on this path
    const ctx = begin(request, reply, config());
    reply.raw.once('finish', () =>
      record(request.id, { method: request.method, status: reply.statusCode, ms: performance.now() - started, outcome: ctx.outcome }),
    );
    Promise.resolve()
      .then(() => admitRequest(store, request, reply, ctx.config.addressSubject(request.ip)))
      .then(
        (refused) => handleError(refused ?? err, request, reply),
        (failed) => handleError(failed, request, reply),
      );
  }

  return { onRequest, onFrameworkError };
}
