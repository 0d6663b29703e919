import type { FastifyReply } from 'fastify';
import { GatewayError } from './errors.js';
import { type Decision, rateLimitHeaders, reportedWindow, retryAfterSeconds } from './headers.js';
import type { QuotaStore, QuotaSubject } from './quota-store.js';

/** The 429 a decision calls for, if any. */
export function refusal(d: Decision): GatewayError | undefined {
  const wait = retryAfterSeconds(d);
  if (d.outcome === 'banned') {
    return new GatewayError('key_banned', `Banned for sending after repeated 429s; retry after ${wait} s`);
  }
  if (d.outcome === 'rejected') {
    const { limit } = reportedWindow(d);
    return d.violated === 'day'
      ? new GatewayError('daily_quota_exceeded', `Daily limit of ${limit} requests reached; retry after ${wait} s`)
      : new GatewayError('rate_limited', `Minute limit of ${limit} requests reached; retry after ${wait} s`);
  }
  return undefined;
}

/**
 * The one place that asks the store for a decision and turns it into headers and, when
 * refused, a 429. The headers go on the reply first, so every later answer carries them.
 */
export async function admit(
  store: QuotaStore,
  reply: FastifyReply,
  subject: QuotaSubject,
  policy: string,
): Promise<Decision> {
  const decision = await store.consume(subject);
  reply.headers(rateLimitHeaders(decision, policy));
  const refused = refusal(decision);
  if (refused) throw refused;
  return decision;
}
