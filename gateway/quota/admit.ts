import { GatewayError, type GatewayErrorCode } from '../errors.js';
import type { AdmissionOutcome, Decision, EventTag, QuotaSubject, Refusal } from './decision.js';
import { rateLimitHeaders, reportedWindow, retryAfterSeconds } from './headers.js';
import { QuotaStoreUnavailable, type RequestPath } from './store.js';
import { WINDOWS, windowRow } from './windows.js';

/** What admission tells the caller: the outcome, the headers every answer carries, and the 429 if refused. */
export interface Admission {
  outcome: AdmissionOutcome;
  /** When an admitted request was counted (the decision's time): what a refund gives back to. */
  countedAtMs?: number;
  headers: Readonly<Record<string, string>>;
  refusal?: GatewayError;
  /** Units of the overage window past its quota, when this admission is among them: billed extra. */
  overage?: number;
  /** The decision's wait on Redis and whether a lease answered it (Decision.redisMs, .leased): for its trace. */
  redisMs?: number;
  leased?: boolean;
  /** The concurrency slot it holds: the caller releases it when the request ends (RequestPath.release). */
  slot?: string;
  /** The decision it was made from: the portal's history keeps each account's last (its windows, its balance). */
  decision?: Decision;
}

const REFUSAL_CODES = {
  banned: 'key_banned',
  credits: 'credits_exhausted',
  concurrent: 'concurrency_limit_exceeded',
  burst: 'burst_limit_exceeded',
  ...Object.fromEntries(WINDOWS.map((w) => [w.name, w.code])),
} as Record<Refusal, GatewayErrorCode>;

/** The 429 a decision calls for, if any. */
function refusal(d: Decision, subject: QuotaSubject): GatewayError | undefined {
  if (d.outcome === 'allowed') return undefined;
  const wait = retryAfterSeconds(d);
  const short = subject.short;
  if (d.outcome === 'concurrent')
    return new GatewayError(
      REFUSAL_CODES.concurrent,
      `Concurrency limit of ${short?.concurrent} requests in flight reached; retry after ${wait} s`,
    );
  if (d.outcome === 'burst')
    return new GatewayError(REFUSAL_CODES.burst, `Burst limit of ${short?.burst?.size} requests reached; retry after ${wait} s`);
  if (d.outcome === 'credits') {
    const then = wait === undefined ? 'top up to continue' : `the next grant comes in ${wait} s, or top up`;
    return new GatewayError('credits_exhausted', `Prepaid credits exhausted (${d.balance ?? 0} left); ${then}`);
  }
  const why =
    d.outcome === 'banned'
      ? 'Banned for sending after repeated 429s'
      : `${windowRow(d.outcome).word} limit of ${reportedWindow(d).limit} requests reached`;
  return new GatewayError(REFUSAL_CODES[d.outcome], `${why}; retry after ${wait} s`);
}

/** Per lasting subject (a key's), its last admission, the decision it was made from, and what its headers were built from. */
const last = new WeakMap<
  QuotaSubject,
  {
    decision: Decision;
    admission: Admission;
    second: number;
  }
>();

/** Whether two decisions of one subject count the same in every window: their headers are the same within a second. */
function sameCounts(a: Decision, b: Decision): boolean {
  if (a.windows.length !== b.windows.length || a.balance !== b.balance) return false;
  for (let i = 0; i < a.windows.length; i++) if (a.windows[i]!.used !== b.windows[i]!.used) return false;
  return true;
}

/**
 * The admission of an allowed decision of a lasting subject (a key's), shared while it can be.
 * A store hands out the same decision object for every unit of a lease within one second: such
 * admissions are one object. Otherwise the rate-limit headers, which depend only on the
 * subject, the windows' counts and the whole second of the decision's time (resets fall on
 * whole seconds), are shared while those stay the same. Shared objects are frozen:
 * `reply.headers()` and the raw answers copy their values. An address's subject is built per
 * request, so no later admission could find its entry: it has none. A balance changes with
 * every admission Redis decides: only a lease's (whose balance is the lease's) are shared.
 */
function sharedAdmission(d: Decision, subject: QuotaSubject): Admission {
  const was = last.get(subject);
  if (was?.decision === d) return was.admission;
  const second = Math.floor(d.nowMs / 1000);
  const headers =
    was && was.second === second && sameCounts(was.decision, d)
      ? was.admission.headers
      : Object.freeze(rateLimitHeaders(d, subject.policy, subject.short));
  const admission = Object.freeze(allowed(d, headers));
  last.set(subject, { decision: d, admission, second });
  return admission;
}

function allowed(d: Decision, headers: Readonly<Record<string, string>>): Admission {
  return {
    outcome: 'allowed',
    countedAtMs: d.nowMs,
    headers,
    refusal: undefined,
    overage: d.overage > 0 ? d.overage : undefined,
    redisMs: d.redisMs,
    leased: d.leased,
    slot: d.slot,
    decision: d,
  };
}

/** What admission makes of a decision. */
function admissionOf(d: Decision, subject: QuotaSubject): Admission {
  if (d.outcome === 'allowed') {
    // Concurrency and burst change with every decision, and every one is Redis's: nothing to share.
    const shared = subject.lasting && d.short === undefined && (d.balance === undefined || d.leased === true);
    return shared ? sharedAdmission(d, subject) : allowed(d, rateLimitHeaders(d, subject.policy, subject.short));
  }
  if (!subject.enforce) return shadow(d, d.outcome, subject);
  return {
    outcome: d.outcome,
    countedAtMs: undefined,
    headers: rateLimitHeaders(d, subject.policy, subject.short),
    refusal: refusal(d, subject),
    overage: undefined,
    redisMs: d.redisMs,
    leased: d.leased,
    slot: undefined,
    decision: d,
  };
}

/** The rate-limit headers admission gives a decision (shared as above). */
export const headersOf = (d: Decision, subject: QuotaSubject) => admissionOf(d, subject).headers;

/** A store that could not decide: Redis failing is a 503 (see UNAVAILABLE); anything else is the gateway's fault. */
function failed(err: unknown, subject: QuotaSubject): Admission {
  if (err instanceof QuotaStoreUnavailable) return UNAVAILABLE(subject);
  throw err;
}

/**
 * The one place that asks the store for a decision: the request hook, framework errors and
 * answers written to raw sockets all come here. It returns the refusal rather than throwing
 * it, like authentication and routing; the caller decides how to answer. Synchronously when
 * the store decided without I/O (a lease, a known ban): no promise on that path.
 */
export function admit(store: RequestPath, subject: QuotaSubject, cost = 1, tag?: EventTag): Admission | Promise<Admission> {
  let decided: Decision | Promise<Decision>;
  try {
    decided = store.consume(subject, cost, tag);
  } catch (err) {
    return failed(err, subject);
  }
  if (decided instanceof Promise) {
    return decided.then(
      (d) => admissionOf(d, subject),
      (err: unknown) => failed(err, subject),
    );
  }
  return admissionOf(decided, subject);
}

/**
 * Shadow mode: the refusal the decision calls for is not made. The request was counted as an
 * enforced one would be (a refusal counts nowhere, so nothing to refund); its headers report
 * the windows as they stand, without the Retry-After that only a refusal carries.
 */
function shadow(decision: Decision, refused: Refusal, subject: QuotaSubject): Admission {
  const headers = rateLimitHeaders(decision, subject.policy, subject.short);
  delete headers['retry-after'];
  return { outcome: `would_${refused}`, headers, redisMs: decision.redisMs, leased: decision.leased, decision };
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
