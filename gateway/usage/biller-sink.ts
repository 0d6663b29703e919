import { createHash } from 'node:crypto';
import { LRUCache } from 'lru-cache';
import { request } from 'undici';
import type { UsageExport } from '../config/usage-export.js';
import { type EncodedEvent, REFUND_TYPE, REQUEST_TYPE, splitEvents, writtenAtOf } from './events.js';
import { isPermanent, waitMs } from './http-sink.js';
import { postDeadline } from './leader.js';
import { type Accepted, HeldIds, type UsageSink } from './sink.js';
import { type StripeSession, withStripeVersion } from './stripe-session.js';

// Stripe's and Lago's sink profiles (issue 49): our CloudEvents translated in the export thread
// into the biller's own batch, and the biller's answers read by its documented rules.

/** Stripe takes an event no older than 35 days (and up to 5 minutes ahead): an older one is refused for ever. */
export const STRIPE_BACKDATE_MS = 35 * 24 * 3600 * 1000;
/** Stripe's `identifier`: at most 100 characters. */
export const STRIPE_IDENTIFIER_MAX = 100;
export const NO_CUSTOMER = 'no customer mapping';
/** POSTs sent again at once after a connection dropped unanswered within UNHEARD_QUICK_MS (Stripe's profile). */
const UNHEARD_AGAIN = 3;
const UNHEARD_QUICK_MS = 1000;
/** An event sent in more than one unanswered POST: which one the biller took, if any, is not known. */
const AMBIGUOUS: readonly string[] = [];
/** Whether the event (id `<account>/<Redis ms>-<seq>…`, events.ts) was written at or after `term` (Redis ms). */
function writtenSince(id: string, term: number): boolean {
  const at = writtenAtOf(id);
  return at !== undefined && at >= term;
}
export const TOO_OLD = "older than Stripe's 35-day backdate window";

/** One usage event as the billers read it. */
export interface Usage {
  id: string;
  customer: string;
  time: string;
  units: number;
  /** The CloudEvent, to set aside as it is. */
  json: EncodedEvent;
}

/** What a 4xx's body says of the events posted: those the biller holds already, those it refuses with why. */
export interface Named {
  held: Set<number>;
  refused: Map<number, string>;
}

interface Profile {
  body(events: readonly Usage[]): string;
  /**
   * It takes a request whole or not at all, and names one held event a refusal (Stripe): one it
   * names from a POST whose answer never came means it took that POST, so it holds all its events.
   */
  namesOne?: true;
  /** Why the biller would refuse it for ever, before any POST. */
  refusedBefore?(u: Usage, now: number): string | undefined;
  named(status: number, body: string, events: readonly Usage[]): Named | undefined;
}

/** Stable across resends, so Stripe's uniqueness check sees a resend as the same event. */
export const stripeIdentifier = (id: string) =>
  id.length <= STRIPE_IDENTIFIER_MAX ? id : `sha256-${createHash('sha256').update(id).digest('base64url')}`;

const errorMessage = (body: string): string => {
  try {
    const m = (JSON.parse(body) as { error?: { message?: unknown } }).error?.message;
    return typeof m === 'string' ? m : '';
  } catch {
    return '';
  }
};

/** The body of Stripe's `POST /v2/billing/meter_event_stream` (test/unit/biller-sdk-types checks it against the `stripe` package's). */
export const stripeBody = (eventName: string, events: readonly Usage[]) => ({
  events: events.map((u) => ({
    event_name: eventName,
    identifier: stripeIdentifier(u.id),
    payload: { stripe_customer_id: u.customer, value: String(u.units) },
    timestamp: u.time,
  })),
});

/** The body of Lago's `POST /api/v1/events/batch` (checked against `lago-javascript-client`'s EventBatchInput). */
export const lagoBody = (code: string, events: readonly Usage[]) => ({
  events: events.map((u) => ({
    transaction_id: u.id,
    external_subscription_id: u.customer,
    code,
    timestamp: Math.floor(Date.parse(u.time) / 1000),
    properties: { units: u.units },
  })),
});

function stripeProfile(eventName: string): Profile {
  return {
    body: (events) => JSON.stringify(stripeBody(eventName, events)),
    namesOne: true,
    refusedBefore: (u, now) => (Date.parse(u.time) < now - STRIPE_BACKDATE_MS ? TOO_OLD : undefined),
    // `400 An event already exists with identifier <id>.`: the event it names is delivered (langfuse/langfuse#16292).
    named: (status, body, events) => {
      const message = errorMessage(body);
      if (status !== 400 || !/already exists with identifier/.test(message)) return undefined;
      let best = -1;
      events.forEach((u, i) => {
        const ident = stripeIdentifier(u.id);
        if (message.includes(`identifier ${ident}`) && (best < 0 || ident.length > stripeIdentifier(events[best]!.id).length)) best = i;
      });
      if (best < 0 && events.length === 1) best = 0;
      return best < 0 ? undefined : { held: new Set([best]), refused: new Map() };
    },
  };
}

function lagoProfile(code: string): Profile {
  return {
    body: (events) => JSON.stringify(lagoBody(code, events)),
    // A 422 refuses the whole batch, its `error_details` by position: `{"3":{"transaction_id":["value_already_exist"]}}` (getlago/lago-api#3049).
    named: (status, body, events) => {
      if (status !== 422) return undefined;
      let details: Record<string, Record<string, unknown>>;
      try {
        details = (JSON.parse(body) as { error_details?: Record<string, Record<string, unknown>> }).error_details ?? {};
      } catch {
        return undefined;
      }
      const named: Named = { held: new Set(), refused: new Map() };
      for (const [at, errors] of Object.entries(details)) {
        const i = Number(at);
        if (!Number.isInteger(i) || i < 0 || i >= events.length || typeof errors !== 'object' || errors === null) continue;
        const fields = Object.entries(errors);
        const seen = fields.every(
          ([f, codes]) => f === 'transaction_id' && Array.isArray(codes) && codes.every((c) => c === 'value_already_exist'),
        );
        if (seen && fields.length > 0) named.held.add(i);
        else named.refused.set(i, `lago answered 422: ${JSON.stringify(errors).slice(0, 200)}`);
      }
      return named.held.size + named.refused.size > 0 ? named : undefined;
    },
  };
}

/** Request and refund events, in the biller's terms; a credits ledger event is no usage (the biller keeps its own credits). */
export function usageOf(json: EncodedEvent, customers: Readonly<Record<string, string>>): Usage | 'not usage' | { unmapped: true } {
  const e = JSON.parse(json) as { id: string; type: string; subject: string; time: string; data: { units?: number } };
  if (e.type !== REQUEST_TYPE && e.type !== REFUND_TYPE) return 'not usage';
  const customer = Object.hasOwn(customers, e.subject) ? customers[e.subject] : undefined;
  if (customer === undefined) return { unmapped: true };
  return { id: e.id, customer, time: e.time, units: Number(e.data.units), json };
}

/**
 * All or none, as every sink: a POST's events are delivered when the biller took them or says it
 * holds them already. A 4xx naming events (a duplicate, or Lago's per-position errors) takes
 * those out and sends the rest again, so the new events of a refused batch land; one that names
 * none is `permanent`, for the exporter to split the batch down to the event refused.
 */
export class BillerSink implements UsageSink {
  private readonly profile: Profile;
  private readonly customers: Readonly<Record<string, string>>;
  private readonly headers: Readonly<Record<string, string>>;
  /** Events the biller is known to hold: not sent again when a round starts over. */
  private readonly known = new HeldIds();
  /** With `namesOne`: each event of a POST whose answer never came, with that POST's ids. */
  private readonly unanswered = new LRUCache<string, readonly string[]>({ max: HeldIds.KEPT });

  constructor(
    readonly target: UsageExport & { format: 'stripe' | 'lago' },
    headers: Readonly<Record<string, string>> = {},
    /** With `stripe.secretKey`: the stream's token comes from it (the config refuses an Authorization header then). */
    private readonly session?: StripeSession,
  ) {
    this.customers = target.customers ?? {};
    this.headers = target.format === 'stripe' ? withStripeVersion(headers) : headers;
    this.profile =
      target.format === 'stripe'
        ? stripeProfile(target.stripe?.eventName ?? 'api_requests')
        : lagoProfile(target.lago?.code ?? 'api_requests');
  }

  get name(): string {
    const u = new URL(this.target.url);
    return `${this.target.format} ${u.protocol}//${u.host}${u.pathname}`;
  }

  async deliver(batch: readonly EncodedEvent[], lost: AbortSignal, term = 0): Promise<Accepted> {
    lost.throwIfAborted();
    const setAside: Array<{ event: EncodedEvent; reason: string }> = [];
    let pending: Usage[] = [];
    let held = 0;
    const now = Date.now();
    for (const part of batch)
      for (const json of splitEvents(part)) {
        const u = usageOf(json, this.customers);
        if (u === 'not usage') continue;
        const why = 'unmapped' in u ? NO_CUSTOMER : this.profile.refusedBefore?.(u, now);
        if (why !== undefined) setAside.push({ event: json, reason: why });
        else if (this.known.has((u as Usage).id))
          continue; // held: not the biller's answer, so no duplicate counted
        else pending.push(u as Usage);
      }
    let renewed = false;
    let unheard = 0;
    const hold = (events: readonly Usage[]) => {
      for (const u of events) this.known.add(u.id);
    };
    // Each turn takes at least one event out, renews the session once, or sends again at once
    // after a connection dropped unanswered (up to UNHEARD_AGAIN in a row), so this ends.
    while (pending.length > 0) {
      const token = await this.session?.token(lost);
      if (typeof token === 'object') return { accepted: 'none', ...token };
      const sentAt = performance.now();
      const answer = await this.post(this.profile.body(pending), lost, token);
      if ('accepted' in answer) {
        this.unansweredPost(pending, term);
        // Dropped, not timed out: the same events again now (the biller names what it took) rather
        // than the whole round again after the export's backoff, which a biller that loses an
        // answer every few POSTs would never let end while held events are named one a POST.
        if (this.profile.namesOne && ++unheard <= UNHEARD_AGAIN && performance.now() - sentAt < UNHEARD_QUICK_MS) continue;
        return answer;
      }
      unheard = 0;
      if (answer.status >= 200 && answer.status < 300) {
        hold(pending);
        break;
      }
      // A token expired early (or revoked): one new session, and the same events again.
      if (answer.status === 401 && token !== undefined && !renewed) {
        this.session!.expire(token);
        renewed = true;
        continue;
      }
      const named = this.profile.named(answer.status, answer.body, pending);
      const reason = `the sink answered ${answer.status}${answer.message ? `: ${answer.message}` : ''}`;
      if (!named) {
        // Another answer than a duplicate named: whether the biller kept the POST is not known either.
        this.unansweredPost(pending, term);
        const after = waitMs(answer.status, answer.headers);
        return {
          accepted: 'none',
          reason,
          ...(after !== undefined && { retryAfterMs: after }),
          ...(isPermanent(answer.status) && { permanent: { status: answer.status } }),
        };
      }
      for (const [i, why] of named.refused) setAside.push({ event: pending[i]!.json, reason: why });
      hold(pending.filter((_, i) => named.held.has(i)));
      this.heldWith(pending.filter((_, i) => named.held.has(i)));
      const before = pending.length - named.refused.size;
      pending = pending.filter((u, i) => !named.held.has(i) && !named.refused.has(i) && !this.known.has(u.id));
      held += before - pending.length;
    }
    return { accepted: 'all', ...(setAside.length > 0 && { setAside }), ...(held > 0 && { held }) };
  }

  /**
   * A POST whose answer never came (or said nothing of duplicates): the biller may have taken it
   * (whole, with `namesOne`), or not. An event named held later says the POST was taken only if
   * that POST is the one ever to carry it: an event sent in an earlier such POST is ambiguous, as
   * is one written before this lead began (`term`), which an earlier leader may have sent.
   */
  private unansweredPost(events: readonly Usage[], term: number): void {
    if (!this.profile.namesOne) return;
    const ids = events.map((u) => u.id);
    for (const id of ids) this.unanswered.set(id, this.unanswered.has(id) || !writtenSince(id, term) ? AMBIGUOUS : ids);
  }

  /** Events the biller named as held: the rest of the one unanswered POST that held each is held too (`namesOne`). */
  private heldWith(named: readonly Usage[]): void {
    for (const u of named) for (const id of this.unanswered.get(u.id) ?? []) this.known.add(id);
  }

  private async post(
    body: string,
    lost: AbortSignal,
    token?: string,
  ): Promise<Accepted | { status: number; body: string; message: string; headers: Record<string, string | string[] | undefined> }> {
    const deadline = postDeadline(lost);
    try {
      const res = await request(this.target.url, {
        method: 'POST',
        headers: { ...this.headers, ...(token !== undefined && { authorization: `Bearer ${token}` }), 'content-type': 'application/json' },
        body,
        signal: deadline.signal,
      });
      const text = await res.body.text();
      // A message that echoes the token (none of Stripe's do) must not carry it into a log line.
      const message = errorMessage(text).slice(0, 200);
      return { status: res.statusCode, body: text, message: token ? message.replaceAll(token, '<token>') : message, headers: res.headers };
    } catch (err) {
      lost.throwIfAborted();
      return { accepted: 'none', reason: (err as Error).message };
    } finally {
      deadline.done();
    }
  }
}
