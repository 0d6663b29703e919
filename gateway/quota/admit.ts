import { GatewayError, type GatewayErrorCode } from '../errors.js';
import type { Decision, Outcome, QuotaSubject, Refusal } from './decision.js';
import { rateLimitHeaders, reportedWindow, retryAfterSeconds } from './headers.js';
import type { QuotaStore } from './store.js';

/** What admission tells the caller: the outcome, the headers every answer carries, and the 429 if refused. */
export interface Admission {
  outcome: Outcome;
  headers: Record<string, string>;
  refusal?: GatewayError;
}

const REFUSAL_CODES: Record<Refusal, GatewayErrorCode> = {
  minute: 'rate_limited',
  day: 'daily_quota_exceeded',
  banned: 'key_banned',
};

/** The 429 a decision calls for, if any. */
function refusal(d: Decision): GatewayError | undefined {
  if (d.outcome === 'allowed') return undefined;
  const wait = retryAfterSeconds(d);
  const why =
    d.outcome === 'banned'
      ? 'Banned for sending after repeated 429s'
      : `${d.outcome === 'day' ? 'Daily' : 'Minute'} limit of ${reportedWindow(d).limit} requests reached`;
  return new GatewayError(REFUSAL_CODES[d.outcome], `${why}; retry after ${wait} s`);
}

/**
 * The one place that asks the store for a decision: the request hook, framework errors and
 * answers written to raw sockets all come here. It returns the refusal rather than throwing
 * it, like authentication and routing; the caller decides how to answer.
 */
export async function admit(store: QuotaStore, subject: QuotaSubject): Promise<Admission> {
  const decision = await store.consume(subject);
  return { outcome: decision.outcome, headers: rateLimitHeaders(decision, subject.policy), refusal: refusal(decision) };
}
