// Usage events as a billing sink reads them: CloudEvents 1.0 in structured JSON, sent in
// batches (application/cloudevents-batch+json, the format OpenMeter's ingest takes). Pure: the
// stream's entries in, the events out.

import { FIXED } from '../quota/windows.js';

/** An entry of an account's usage stream (Redis XRANGE): its id and its field list. */
export type StreamEntry = [id: string, fields: string[]];

export interface CloudEvent {
  specversion: '1.0';
  id: string;
  source: string;
  type: string;
  subject: string;
  time: string;
  datacontenttype: 'application/json';
  data: Record<string, unknown>;
}

export const REQUEST_TYPE = 'com.petstore.gateway.request';
export const REFUND_TYPE = 'com.petstore.gateway.request.refunded';
/** A credits ledger entry, by its kind: the sink holds the whole ledger, Redis its last entries. */
export const CREDITS_TYPES: Readonly<Record<string, string>> = {
  topup: 'com.petstore.gateway.credits.topped_up',
  grant: 'com.petstore.gateway.credits.granted',
};

/** How long an event waits for its status record before it is sent with `status: null` (its instance died first). */
export const STATUS_WAIT_MS = 10_000;

const fieldsOf = (list: string[]) => {
  const f: Record<string, string> = {};
  for (let i = 0; i < list.length; i += 2) f[list[i]!] = list[i + 1]!;
  return f;
};
const num = (v: string | undefined) => (v === undefined ? null : Number(v));
/** An event's id: the account and its stream entry's id, unique and the same however often it is sent. */
export const eventId = (account: string, entryId: string) => `${account}/${entryId}`;

function requestEvent(account: string, source: string, id: string, f: Record<string, string>, status: number | null): CloudEvent {
  const credits = Number(f.credits);
  return {
    specversion: '1.0',
    id: eventId(account, id),
    source,
    type: REQUEST_TYPE,
    subject: account,
    time: new Date(Number(f.at)).toISOString(),
    datacontenttype: 'application/json',
    data: {
      requestId: f.rid,
      keyId: f.key,
      plan: f.plan,
      route: f.route,
      method: f.method,
      units: Number(f.units),
      status,
      // Each fixed window by its name (windows.ts; null: the plan has none), then the billing period's.
      windows: { ...Object.fromEntries(FIXED.map((w) => [w.name, num(f[w.name])])), month: Number(f.month) || null },
      overage: Number(f.overage),
      credits: credits >= 0 ? credits : null,
    },
  };
}

function refundEvent(account: string, source: string, id: string, f: Record<string, string>): CloudEvent {
  return {
    specversion: '1.0',
    id: eventId(account, id),
    source,
    type: REFUND_TYPE,
    subject: account,
    time: new Date(Number(f.at)).toISOString(),
    datacontenttype: 'application/json',
    // The overage the refund takes back, when it takes some (refund.lua).
    data: { refundOf: eventId(account, f.ref!), units: -Number(f.units), ...(Number(f.overage) > 0 && { overage: -Number(f.overage) }) },
  };
}

function creditsEvent(account: string, source: string, id: string, f: Record<string, string>): CloudEvent {
  const data: Record<string, unknown> = { ledgerEntry: f.ledger, amount: Number(f.amount), balance: Number(f.balance) };
  if (f.entry === 'grant') {
    Object.assign(data, { periods: Number(f.periods), expired: Number(f.expired), period: new Date(Number(f.period)).toISOString() });
  } else Object.assign(data, { reason: f.reason, idempotencyKey: f.idempotencyKey });
  return {
    specversion: '1.0',
    id: eventId(account, id),
    source,
    type: CREDITS_TYPES[f.entry!]!,
    subject: account,
    time: new Date(Number(f.at)).toISOString(),
    datacontenttype: 'application/json',
    data,
  };
}

/**
 * The CloudEvents of an account's entries, in order, at most `max`, and the id of the last
 * entry they consume. A request's status is joined from `statuses` (by its entry's id); one still
 * without one, younger than STATUS_WAIT_MS, stops the batch there, to be read again next time.
 */
export function toCloudEvents(
  account: string,
  source: string,
  entries: StreamEntry[],
  statuses: ReadonlyMap<string, number>,
  nowMs: number,
  max = Number.POSITIVE_INFINITY,
): { events: CloudEvent[]; last?: string; consumed: number } {
  const parsed = entries.map(([id, list]) => [id, fieldsOf(list)] as const);
  const events: CloudEvent[] = [];
  let last: string | undefined;
  let consumed = 0;
  for (const [id, f] of parsed) {
    if (events.length >= max) break;
    if (f.kind === 'request') {
      // A leased admission's event carries its status ('-': none known); another's is joined from `statuses`.
      const status = f.status !== undefined ? (f.status === '-' ? null : Number(f.status)) : statuses.get(id);
      if (status === undefined && nowMs - Number(f.at) < STATUS_WAIT_MS) break;
      events.push(requestEvent(account, source, id, f, status ?? null));
    } else if (f.kind === 'refund') {
      events.push(refundEvent(account, source, id, f));
    } else if (f.kind === 'credits') {
      events.push(creditsEvent(account, source, id, f));
    }
    last = id;
    consumed++;
  }
  return { events, last, consumed };
}

/** The stream id right after `id`: XTRIM MINID of it removes `id` too. */
export function nextId(id: string): string {
  const [ms, seq] = id.split('-');
  return `${ms}-${Number(seq) + 1}`;
}
