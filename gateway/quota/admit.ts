import { GatewayError, type GatewayErrorCode } from '../http/errors.js';
import type { AdmissionOutcome, Decision, EventTag, QuotaSubject, Refusal } from './decision.js';
import { rateLimitHeaders, reportedWindow, retryAfterSeconds } from './headers.js';
import { type QuotaStore, QuotaStoreUnavailable } from './store.js';

/** What admission tells the caller: the outcome, the headers every answer carries, and the 429 if refused. */
export interface Admission {
  outcome: AdmissionOutcome;
  /** When an admitted request was counted (the decision's time): what a refund gives back to. */
  countedAtMs?: number;
  headers: Readonly<Record<string, string>>;
  refusal?: GatewayError;
  /** Units of the overage window past its quota, when this admission is among them: billed extra. */
  overage?: number;
  /** Its usage event, when its subject records them: the final status is joined to it. */
  eventId?: string;
  /** The decision's wait on Redis and whether a lease answered it (Decision.redisMs, .leased): for its trace. */
  redisMs?: number;
  leased?: boolean;
}

const REFUSAL_CODES: Record<Refusal, GatewayErrorCode> = {
  minute: 'rate_limited',
  day: 'daily_quota_exceeded',
  banned: 'key_banned',
  month: 'monthly_quota_exceeded',
  credits: 'credits_exhausted',
};

const WINDOW_WORD = { minute: 'Minute', day: 'Daily', month: 'Monthly' } as const;

/** The 429 a decision calls for, if any. */
function refusal(d: Decision): GatewayError | undefined {
  if (d.outcome === 'allowed') return undefined;
  const wait = retryAfterSeconds(d);
  if (d.outcome === 'credits') {
    const then = wait === undefined ? 'top up to continue' : `the next grant comes in ${wait} s, or top up`;
    return new GatewayError('credits_exhausted', `Prepaid credits exhausted (${d.balance ?? 0} left); ${then}`);
  }
  const why =
    d.outcome === 'banned'
      ? 'Banned for sending after repeated 429s'
      : `${WINDOW_WORD[d.outcome]} limit of ${reportedWindow(d).limit} requests reached`;
  return new GatewayError(REFUSAL_CODES[d.outcome], `${why}; retry after ${wait} s`);
}

/** Per lasting subject (a key's), the last admission's headers and what they were built from. */
const lastHeaders = new WeakMap<
  QuotaSubject,
  { second: number; minuteUsed: number; dayUsed: number; monthUsed: number; headers: Readonly<Record<string, string>> }
>();

/**
 * The rate-limit headers of a decision. An admission's headers depend only on its subject, the
 * windows' counts and the whole second of its time (resets fall on whole seconds), so
 * admissions served from one lease within one second share the same headers, built once. The
 * shared object is frozen: `reply.headers()` and the raw answers copy its values. An address's
 * subject is built per request, so no later admission could find its entry: it has none.
 */
export function headersOf(d: Decision, subject: QuotaSubject): Readonly<Record<string, string>> {
  // A balance changes with every admission (credits are never leased): nothing to share.
  if (d.outcome !== 'allowed' || !subject.lasting || d.balance !== undefined) return rateLimitHeaders(d, subject.policy);
  const second = Math.floor(d.nowMs / 1000);
  const minuteUsed = d.windows[0]!.used;
  const dayUsed = d.windows[1]?.used ?? 0;
  const monthUsed = d.windows[2]?.used ?? 0;
  const last = lastHeaders.get(subject);
  if (last && last.second === second && last.minuteUsed === minuteUsed && last.dayUsed === dayUsed && last.monthUsed === monthUsed) {
    return last.headers;
  }
  const headers = Object.freeze(rateLimitHeaders(d, subject.policy));
  lastHeaders.set(subject, { second, minuteUsed, dayUsed, monthUsed, headers });
  return headers;
}

/**
 * The one place that asks the store for a decision: the request hook, framework errors and
 * answers written to raw sockets all come here. It returns the refusal rather than throwing
 * it, like authentication and routing; the caller decides how to answer.
 */
export async function admit(store: QuotaStore, subject: QuotaSubject, cost = 1, tag?: EventTag): Promise<Admission> {
  let decision: Decision;
  try {
    decision = await store.consume(subject, cost, tag);
  } catch (err) {
    if (err instanceof QuotaStoreUnavailable) return UNAVAILABLE(subject);
    throw err;
  }
  if (decision.outcome !== 'allowed' && !subject.enforce) return shadow(decision, decision.outcome, subject);
  return {
    outcome: decision.outcome,
    countedAtMs: decision.outcome === 'allowed' ? decision.nowMs : undefined,
    headers: headersOf(decision, subject),
    refusal: refusal(decision),
    overage: decision.outcome === 'allowed' && decision.overage > 0 ? decision.overage : undefined,
    eventId: decision.eventId,
    redisMs: decision.redisMs,
    leased: decision.leased,
  };
}

/**
 * Shadow mode: the refusal the decision calls for is not made. The request was counted as an
 * enforced one would be (a refusal counts nowhere, so nothing to refund); its headers report
 * the windows as they stand, without the Retry-After that only a refusal carries.
 */
function shadow(decision: Decision, refused: Refusal, subject: QuotaSubject): Admission {
  const headers = rateLimitHeaders(decision, subject.policy);
  delete headers['retry-after'];
  return { outcome: `would_${refused}`, headers, redisMs: decision.redisMs, leased: decision.leased };
}

/**
 * Failing closed while Redis fails: a 503 that blames the store, not the client. The policy is
 * known; the windows' state is not, so no header claims it. Redis is tried again every second.
 */
const UNAVAILABLE = (subject: QuotaSubject): Admission => ({
  outcome: 'unavailable',
  headers: { 'ratelimit-policy': subject.policy, 'retry-after': '1' },
  refusal: new GatewayError('quota_store_unavailable', 'The quota store is not answering; retry after 1 s'),
});
