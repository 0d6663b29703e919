import type { FastifyReply, FastifyRequest } from 'fastify';
import type { Consumer } from '../config/config.js';
import type { GatewayMetrics, RejectionReason } from './metrics.js';
import type { AdmissionOutcome, Decision } from '../quota/decision.js';
import { isWindow } from '../quota/windows.js';
import { jsonString } from '../json.js';
import type { RouteId } from '../routes.js';
import type { LogOutput } from '../../runtime/process.js';

export type AccessOutcome = AdmissionOutcome | 'unauthenticated';

/** Whichever path answered it: proxy, hook, framework error, raw socket. */
export interface AccessEntry {
  method: string;
  status: number;
  ms: number;
  consumer?: Consumer;
  route?: RouteId;
  outcome?: AccessOutcome;
  /** Units past the quota after this request, when it was admitted among them (billed extra). */
  overage?: number;
  /** The quota decision it was answered from, when one was made (the portal's history reads its windows and balance). */
  decision?: Decision;
}

/** A 401, or a 429 without a key, is "unauthenticated". */
function rejection(e: AccessEntry): RejectionReason | undefined {
  if (e.status === 401 || (e.status === 429 && !e.consumer)) return 'unauthenticated';
  if (e.outcome === 'unavailable') return 'unavailable';
  const { outcome } = e;
  if (e.status === 402 && outcome === 'credits') return outcome;
  const quota = outcome !== undefined && (isWindow(outcome) || outcome === 'banned' || outcome === 'concurrent' || outcome === 'burst');
  return e.status === 429 && quota ? outcome : undefined;
}

/** JSON of `ms` to a tenth, from two integers V8 stringifies from a cache: a fraction was the line's costliest step. */
export function tenths(ms: number): string {
  const t = Math.round(ms * 10);
  if (!(t >= 0 && t <= 0x3fffffff)) return JSON.stringify(t / 10); // negative, huge or NaN: the general path
  const digit = t % 10;
  return digit === 0 ? `${t / 10}` : `${(t - digit) / 10}.${digit}`;
}

/**
 * The line `log.info(fields, 'request')` would write (a test compares the two), built by hand: pino's generic
 * serializer takes twice the CPU (2.8 against 1.4 us).
 */
export function accessLine(output: LogOutput): (reqId: string, e: AccessEntry) => void {
  const { log, destination, time, fixedFields } = output;
  return function writeAccessLine(reqId: string, e: AccessEntry): void {
    if (!log.isLevelEnabled('info')) return;
    let line = `{"level":30${time()}${fixedFields},"reqId":${jsonString(reqId)}`;
    if (e.consumer) line += keyFields(e.consumer);
    line += `,"route":${e.route === undefined ? 'null' : quoted(e.route)},"method":${quoted(e.method)},"status":${e.status},"ms":${tenths(e.ms)}`;
    if (e.outcome !== undefined) line += `,"outcome":"${e.outcome}"`;
    if (e.overage !== undefined) line += `,"overage":${e.overage}`;
    destination.write(`${line},"msg":"request"}\n`);
  };
}

/** A reload makes new consumers, and so new entries. */
const keyFieldsOf = new WeakMap<Consumer, string>();
function keyFields(c: Consumer): string {
  let fields = keyFieldsOf.get(c);
  if (fields === undefined) {
    fields = `,"keyId":${JSON.stringify(c.id)},"plan":${JSON.stringify(c.plan)}`;
    keyFieldsOf.set(c, fields);
  }
  return fields;
}

const quotedNames = new Map<string, string>();
function quoted(name: string): string {
  let q = quotedNames.get(name);
  if (q === undefined) {
    q = JSON.stringify(name);
    // Methods come from clients: only so many are kept.
    if (quotedNames.size < 64) quotedNames.set(name, q);
  }
  return q;
}

/** The root logger writes the line with the request id as its first field: no child logger per request. */
export function accessLog(
  metrics: GatewayMetrics,
  output: LogOutput,
  recordStatus?: (request: FastifyRequest, status: number) => void,
  /** Also told of every answer (the portal's history counts outcomes in memory from it). */
  count?: (e: AccessEntry) => void,
) {
  const line = accessLine(output);
  function record(reqId: string, e: AccessEntry): void {
    metrics.request(e.route ?? 'none', e.status, e.consumer?.plan ?? 'none', e.consumer?.id, rejection(e));
    if (e.consumer && e.outcome?.startsWith('would_')) metrics.wouldReject.inc({ reason: e.outcome.slice(6), plan: e.consumer.plan });
    if (e.consumer && e.overage !== undefined) metrics.overage.inc({ plan: e.consumer.plan });
    count?.(e);
    line(reqId, e);
  }
  /** Callback style: no promise per request. */
  function onResponse(request: FastifyRequest, reply: FastifyReply, done: () => void): void {
    const { consumer, route, outcome, overage, eventId, decision } = request.ctx;
    record(request.id, {
      method: request.method,
      status: reply.statusCode,
      ms: reply.elapsedTime,
      consumer,
      route,
      outcome,
      overage,
      decision,
    });
    // In this hook, not one more: the status of a request whose usage event was written.
    if (eventId !== undefined && recordStatus) recordStatus(request, reply.statusCode);
    done();
  }
  return { record, onResponse };
}
