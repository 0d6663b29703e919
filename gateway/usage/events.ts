// Usage events as a billing sink reads them: CloudEvents 1.0 in structured JSON, sent in
// batches (application/cloudevents-batch+json, the format OpenMeter's ingest takes). Pure: the
// stream's entries in, the events out.

import { FIXED, type WindowRow } from '../quota/windows.js';
import { COMPACT } from '../quota/bundle.js';

/** An entry of a stream (Redis XRANGE): its id and its field list. */
export type StreamEntry = [id: string, fields: string[]];

/**
 * An account's usage entries as the exporter reads them (cursors.ts, READ_USAGE): flat, ENTRY
 * values an entry, in stream order. A leased admission's entry as a gateway before the bundles
 * wrote it (usagebatch.lua's layout then, `kind request at <ms> data <json>`: what an upgrade
 * finds in the stream) comes as its `id, at, data`, three strings; any other as `id, '',
 * fields`. Leased admissions' events are in the bundles now (bundledEvent).
 */
export type UsageEntries = Array<string | string[]>;
/** Values an entry in UsageEntries. */
export const ENTRY = 3;
/** The id of entry `i` of UsageEntries. */
export const entryId = (entries: UsageEntries, i: number) => entries[i * ENTRY] as string;

/** CloudEvents in structured JSON, as a sink is handed them: one, or a bundle's, comma-separated (a batch of them is a JSON array). */
export type EncodedEvent = string;

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

/** A request event's `data`: what a sink bills by. */
export interface RequestData {
  requestId: string;
  keyId: string;
  plan: string;
  route: string;
  method: string;
  units: number;
  /** The answer's status; null: none known (its instance died first, or none came in time). */
  status: number | null;
  /** Each fixed window's count by its name (windows.ts; null: the plan has none), then the billing period's. */
  windows: Record<string, number | null>;
  overage: number;
  /** The balance after it; null: the plan has no credits, or the admission came from a lease. */
  credits: number | null;
}

/**
 * The field of a leased admission's `data`, already in JSON, in the entries a gateway before the
 * bundles wrote to the stream (UsageEntries): still read, and sent as it is.
 */
export const DATA_FIELD = 'data';

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

/** The windows of an event: each fixed window's count by its name (null: the plan has none), then the billing period's (null: none, or 0). */
export function eventWindows(count: (w: WindowRow) => number | null, month: number): RequestData['windows'] {
  const windows: RequestData['windows'] = {};
  for (const w of FIXED) windows[w.name] = count(w);
  windows.month = month || null;
  return windows;
}

function requestEvent(account: string, source: string, id: string, f: Record<string, string>, status: number | null): CloudEvent {
  const credits = Number(f.credits);
  const data: RequestData = {
    requestId: f.rid!,
    keyId: f.key!,
    plan: f.plan!,
    route: f.route!,
    method: f.method!,
    units: Number(f.units),
    status,
    windows: eventWindows((w) => num(f[w.name]), Number(f.month)),
    overage: Number(f.overage),
    credits: credits >= 0 ? credits : null,
  };
  return { ...head(account, source, id, REQUEST_TYPE, f.at!), data: data as unknown as Record<string, unknown> };
}

/** Every field of an event but its data. */
function head(account: string, source: string, id: string, type: string, at: string): Omit<CloudEvent, 'data'> {
  return {
    specversion: '1.0',
    id: eventId(account, id),
    source,
    type,
    subject: account,
    time: isoTime(at),
    datacontenttype: 'application/json',
  };
}

/**
 * The ISO time of a Redis ms time (toISOString's): its second's part made once a second, its
 * milliseconds added, as an exporter frames some thousands of events a second, each its own ms.
 */
let lastSecond = Number.NaN;
let secondIso = '';
function isoTime(at: string | number): string {
  const ms = Number(at);
  const second = Math.floor(ms / 1000);
  if (second !== lastSecond) {
    // Up to and with the dot: `…T22:13:20.`
    secondIso = new Date(second * 1000).toISOString().slice(0, -4);
    lastSecond = second;
  }
  const frac = ms - second * 1000;
  return `${secondIso}${frac < 10 ? '00' : frac < 100 ? '0' : ''}${frac}Z`;
}

/**
 * Leased admissions' events of one account in JSON, from entries in the stream's earlier layout
 * (DATA_FIELD): the parts the account and source fix escaped once, then per event its id (a
 * stream id: digits and a dash), its time and its data as its instance encoded it. The same JSON
 * as JSON.stringify of the event would give.
 */
function leasedEncoder(account: string, source: string): (id: string, at: string, data: string) => EncodedEvent {
  const id = JSON.stringify(eventId(account, '')).slice(0, -1);
  const after = `","source":${JSON.stringify(source)},"type":"${REQUEST_TYPE}","subject":${JSON.stringify(account)},"time":"`;
  return (entryId, at, data) =>
    `{"specversion":"1.0","id":${id}${entryId}${after}${isoTime(at)}","datacontenttype":"application/json","data":${data}}`;
}

/**
 * The marks in a bundle a gateway before the compact layout wrote (its data starts with `{`):
 * each event was encoded whole by its instance but for the bundle's stream id and the account
 * and source, which these stood for. Still read, so an upgrade sends what its predecessor wrote.
 */
const ID_MARK = '\u0000';
const HEAD_MARK = '\u0001';

/** The id of a bundle's `k`th event, `bundle` its stream id. */
export const bundledId = (bundle: string, k: number | string) => `${bundle}.${k}`;

/** A bundle as the exporter reads it (cursors.ts, READ_USAGE): its stream id, events, and what usagebatch.lua wrote. */
export interface Bundle {
  id: string;
  /** Its events, refunds among them. */
  events: number;
  /** The events the account's bundles took, up to this one: what the cursor counts by. */
  upto: number;
  /** Its request events: bundleData's layout, or an earlier gateway's (each event in JSON with its marks, comma-separated). */
  data: string;
  /** Per refund, `index units overage`, space-separated ('': none). */
  refunds: string;
}

/**
 * A bundle's events, as a JSON array's elements, comma-separated: its request events, framed
 * here (compactEvents; a bundle an earlier gateway wrote: its marks filled in), then a refund
 * event per refund, for the event it refunds (`<bundle>.<k>.refund`), at the bundle's time.
 */
export function bundleEvents(account: string, source: string, b: Bundle): string {
  const id = JSON.stringify(eventId(account, b.id)).slice(1, -1);
  const shared = `","source":${JSON.stringify(source)},"type":"${REQUEST_TYPE}","subject":${JSON.stringify(account)},"time":"`;
  let json = b.data.startsWith(COMPACT)
    ? compactEvents(`{"specversion":"1.0","id":"${id}.`, shared, b.data)
    : b.data.replaceAll(ID_MARK, id).replaceAll(HEAD_MARK, shared);
  if (b.refunds === '') return json;
  const r = b.refunds.split(' ');
  const at = b.id.split('-')[0]!;
  for (let i = 0; i < r.length; i += 3) {
    const of = bundledId(b.id, r[i]!);
    const f = { ref: of, units: r[i + 1]!, overage: r[i + 2]!, at };
    json += `,${JSON.stringify(refundEvent(account, source, `${of}.refund`, f))}`;
  }
  return json;
}

/**
 * A compact bundle's request events (bundleData): each line framed, its head put back by its
 * index and its windows named. `start` is every event's JSON up to its index in the bundle,
 * `shared` from after it up to its time. The same JSON as JSON.stringify of the event
 * requestEvent would build, with one unit, no overage (a lease carries none) and no balance (a
 * credit lease's is Redis's).
 */
function compactEvents(start: string, shared: string, data: string): string {
  const [, names, from, heads, lines] = data.split(COMPACT) as [string, string, string, string, string];
  const at = Number(from);
  // Each window's name, with what goes before it: `{"minute":`, then `,"hour":` and so on.
  const keys = names.split(',').map((n, i) => `${i === 0 ? '{' : ','}${JSON.stringify(n)}:`);
  const last = keys.length - 1;
  // Per head, the data from after the request id to the status.
  const mids = heads.split('\n').map((h) => `,${h},"units":1,"status":`);
  let json = '';
  // One pass over the lines, by position: no array of lines or values, each event one string.
  for (let k = 0, p = 0; p < lines.length; k++) {
    // eventLine: head since status windows "requestId"
    const a = lines.indexOf(' ', p);
    const t = lines.indexOf(' ', a + 1);
    const s = lines.indexOf(' ', t + 1);
    const w = lines.indexOf(' ', s + 1);
    let end = lines.indexOf('\n', w + 1);
    if (end < 0) end = lines.length;
    let windows = '';
    for (let i = 0, v = s + 1; i <= last; i++) {
      const c = i < last ? lines.indexOf(',', v) : w;
      windows += keys[i]! + lines.slice(v, c);
      v = c + 1;
    }
    json +=
      `${k === 0 ? '' : ','}${start}${k}${shared}${isoTime(at + Number(lines.slice(a + 1, t)))}","datacontenttype":"application/json",` +
      `"data":{"requestId":${lines.slice(w + 1, end)}${mids[Number(lines.slice(p, a))]}${lines.slice(t + 1, s)},` +
      `"windows":${windows}},"overage":0,"credits":null}}`;
    p = end + 1;
  }
  return json;
}

/**
 * The events of `json` (bundleEvents: a JSON array's elements), one string each: for the rare
 * sink batch smaller than a bundle. Each event starts with its `specversion`, and a quote in a
 * value is escaped, so the text below meets only where one event ends and the next begins.
 */
export function splitEvents(json: string): string[] {
  const between = ',{"specversion":"1.0",';
  return json.split(between).map((e, i) => (i === 0 ? e : `{"specversion":"1.0",${e}`));
}

function refundEvent(account: string, source: string, id: string, f: Record<string, string>): CloudEvent {
  return {
    ...head(account, source, id, REFUND_TYPE, f.at!),
    // The overage the refund takes back, when it takes some (refund.lua).
    data: { refundOf: eventId(account, f.ref!), units: -Number(f.units), ...(Number(f.overage) > 0 && { overage: -Number(f.overage) }) },
  };
}

function creditsEvent(account: string, source: string, id: string, f: Record<string, string>): CloudEvent {
  const data: Record<string, unknown> = { ledgerEntry: f.ledger, amount: Number(f.amount), balance: Number(f.balance) };
  if (f.entry === 'grant') {
    Object.assign(data, { periods: Number(f.periods), expired: Number(f.expired), period: new Date(Number(f.period)).toISOString() });
  } else Object.assign(data, { reason: f.reason, idempotencyKey: f.idempotencyKey });
  return { ...head(account, source, id, CREDITS_TYPES[f.entry!]!, f.at!), data };
}

/**
 * A request entry's status, for an entry READ_USAGE does not give flat (a flat one carries its
 * status in its data): carried by a leased one an older gateway wrote ('-': none known), joined
 * from `statuses` for quota.lua's (undefined: not yet).
 */
function statusOf(id: string, f: Record<string, string>, statuses: ReadonlyMap<string, number>): number | null | undefined {
  if (f.status !== undefined) return f.status === '-' ? null : Number(f.status);
  return statuses.get(id);
}

/**
 * How many of an account's entries, in order, can go now: a request without a
 * status yet, younger than STATUS_WAIT_MS, stops them there, to be read again next time.
 */
export function consumable(entries: UsageEntries, statuses: ReadonlyMap<string, number>, nowMs: number): number {
  let n = 0;
  for (let i = 0; i < entries.length; i += ENTRY) {
    const fields = entries[i + 2]!;
    // A leased admission's (flat: a string) carries its status in its data: it can always go.
    if (typeof fields !== 'string') {
      const f = fieldsOf(fields);
      if (f.kind === 'request' && statusOf(entries[i] as string, f, statuses) === undefined && nowMs - Number(f.at) < STATUS_WAIT_MS) break;
    }
    n++;
  }
  return n;
}

/**
 * The CloudEvents of an account's first `consumed` entries (what `consumable` said can go), in
 * order, each in structured JSON, and the id of the last. A request's status is joined from
 * `statuses` (by its entry's id) unless it carries its own. `joined`: the ids whose statuses came
 * from `statuses`, to be deleted once the batch went.
 */
export function toCloudEvents(
  account: string,
  source: string,
  entries: UsageEntries,
  statuses: ReadonlyMap<string, number>,
  consumed: number,
): { events: EncodedEvent[]; last?: string; joined: string[] } {
  const events: EncodedEvent[] = [];
  const joined: string[] = [];
  let last: string | undefined;
  const leased = leasedEncoder(account, source);
  for (let i = 0; i < consumed * ENTRY; i += ENTRY) {
    const id = entries[i] as string;
    const fields = entries[i + 2]!;
    last = id;
    if (typeof fields === 'string') {
      events.push(leased(id, entries[i + 1] as string, fields));
      continue;
    }
    const f = fieldsOf(fields);
    if (f.kind === 'request') {
      if (f.status === undefined) joined.push(id);
      events.push(JSON.stringify(requestEvent(account, source, id, f, statusOf(id, f, statuses) ?? null)));
    } else if (f.kind === 'refund') {
      events.push(JSON.stringify(refundEvent(account, source, id, f)));
    } else if (f.kind === 'credits') {
      events.push(JSON.stringify(creditsEvent(account, source, id, f)));
    }
  }
  return { events, last, joined };
}

/** The stream id right after `id`: XTRIM MINID of it removes `id` too. */
export function nextId(id: string): string {
  const [ms, seq] = id.split('-');
  return `${ms}-${Number(seq) + 1}`;
}
