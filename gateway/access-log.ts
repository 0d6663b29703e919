import type { FastifyBaseLogger, FastifyReply, FastifyRequest } from 'fastify';
import type { Consumer } from './config.js';
import type { GatewayMetrics, RejectionReason } from './metrics.js';
import type { AdmissionOutcome } from './quota/decision.js';
import type { RouteId } from './routes.js';

/** One answered request, whichever path answered it (proxy, hook, framework error, raw socket). */
export interface AccessEntry {
  method: string;
  status: number;
  ms: number;
  consumer?: Consumer;
  route?: RouteId;
  outcome?: AdmissionOutcome;
}

/** Why a request was refused, for the metric: a 401, or a 429 without a key, is "unauthenticated". */
function rejection(e: AccessEntry): RejectionReason | undefined {
  if (e.status === 401 || (e.status === 429 && !e.consumer)) return 'unauthenticated';
  if (e.outcome === 'unavailable') return 'unavailable';
  return e.status === 429 && e.outcome && e.outcome !== 'allowed' ? e.outcome : undefined;
}

/**
 * The access line and the request metrics: one of each for every answer. The line is written
 * by the root logger with the request id as its first field (the same line a request's child
 * logger would write), so no child logger is made for it.
 */
export function accessLog(metrics: GatewayMetrics, log: FastifyBaseLogger) {
  function record(reqId: string, e: AccessEntry): void {
    metrics.request(e.route ?? 'none', e.status, e.consumer?.plan ?? 'none', e.consumer?.id, rejection(e));
    log.info(
      {
        reqId,
        keyId: e.consumer?.id,
        plan: e.consumer?.plan,
        route: e.route ?? null,
        method: e.method,
        status: e.status,
        ms: Math.round(e.ms * 10) / 10,
        outcome: e.outcome,
      },
      'request',
    );
  }
  /** fastify's onResponse hook (callback style: no promise per request): the request's context as the pipeline left it. */
  function onResponse(request: FastifyRequest, reply: FastifyReply, done: () => void): void {
    const { consumer, route, outcome } = request.ctx;
    record(request.id, { method: request.method, status: reply.statusCode, ms: reply.elapsedTime, consumer, route, outcome });
    done();
  }
  return { record, onResponse };
}
