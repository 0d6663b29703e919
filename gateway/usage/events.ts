// CloudEvents 1.0 in structured JSON, batched as application/cloudevents-batch+json (OpenMeter's ingest format).

import { FIXED, type WindowRow } from '../quota/windows.js';
import { COMPACT } from '../quota/bundle.js';

export type StreamEntry = [id: string, fields: string[]];

/** Flat, ENTRY values each: a pre-bundle leased entry (an upgrade still finds some) as `id, at, data`; others `id, '', fields`. */
export type UsageEntries = Array<string | string[]>;
export const ENTRY = 3;
export const entryId = (entries: UsageEntries, i: number) => entries[i * ENTRY] as string;

/** One event, or a bundle's, comma-separated: a batch of them is a JSON array. */
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
/**
 * A refund's type by the export's format: OpenMeter meters one exact type, so there a refund is
 * a request event with negative units (its SUM meter nets it); elsewhere it is a type of its own.
 */
export const refundTypeOf = (format: string | undefined) => (format === 'openmeter' ? REQUEST_TYPE : REFUND_TYPE);
/** By ledger entry kind: the sink holds the whole ledger, Redis only its last entries. */
export const CREDITS_TYPES: Readonly<Record<string, string>> = {
  topup: 'com.petstore.gateway.credits.topped_up',
  grant: 'com.petstore.gateway.credits.granted',
};

export interface RequestData {
  requestId: string;
  keyId: string;
  plan: string;
  route: string;
  method: string;
  units: number;
  /** null: none known (its instance died first, or none came in time). */
  status: number | null;
  /** By window name (null: the plan has none), then the billing period's. */
  windows: Record<string, number | null>;
  overage: number;
  /** The balance after it; null: no credits in the plan, or a leased admission. */
  credits: number | null;
  /** Paid with credits: its units' credits from the grant (spent first) and purchased. Absent: not paid with credits. */
  creditsApplied?: { granted: number; purchased: number };
}

/** A pre-bundle leased entry's data, already in JSON: still read, and sent as it is. */
export const DATA_FIELD = 'data';

/** Then it is sent with `status: null`: its instance died before writing it. */
export const STATUS_WAIT_MS = 10_000;

const fieldsOf = (list: string[]) => {
  const f: Record<string, string> = {};
  for (let i = 0; i < list.length; i += 2) f[list[i]!] = list[i + 1]!;
  return f;
};
const num = (v: string | undefined) => (v === undefined ? null : Number(v));
/** Stable however often it is sent, so a sink can dedupe by it. */
export const eventId = (account: string, entryId: string) => `${account}/${entryId}`;

/**
 * When the stream entry an event id names was written (Redis ms): `<account>/<ms>-<seq>`, a
 * bundled event's `.<k>` and a refund's `.refund` after it. Undefined for an id naming no entry
 * (a period close, `<account>/period/<start>`). Account names hold no `/` (AccountName).
 */
export function writtenAtOf(id: string): number | undefined {
  const entry = id.slice(id.indexOf('/') + 1);
  const dash = entry.indexOf('-');
  const ms = dash > 0 ? Number(entry.slice(0, dash)) : Number.NaN;
  return Number.isInteger(ms) ? ms : undefined;
}

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
  if (f.cg !== undefined) data.creditsApplied = { granted: Number(f.cg), purchased: data.units - Number(f.cg) };
  return { ...head(account, source, id, REQUEST_TYPE, f.at!), data: data as unknown as Record<string, unknown> };
}

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

// toISOString's output, its second's part made once a second: an exporter frames thousands of events a second.
let lastSecond = Number.NaN;
let secondIso = '';
function isoTime(at: string | number): string {
  const ms = Number(at);
  const second = Math.floor(ms / 1000);
  if (second !== lastSecond) {
    secondIso = new Date(second * 1000).toISOString().slice(0, -4);
    lastSecond = second;
  }
  const frac = ms - second * 1000;
  return `${secondIso}${frac < 10 ? '00' : frac < 100 ? '0' : ''}${frac}Z`;
}

/** Pre-bundle leased entries (DATA_FIELD), the JSON.stringify of the event; a stream id needs no escaping. */
function leasedEncoder(account: string, source: string): (id: string, at: string, data: string) => EncodedEvent {
  const id = JSON.stringify(eventId(account, '')).slice(0, -1);
  const after = `","source":${JSON.stringify(source)},"type":"${REQUEST_TYPE}","subject":${JSON.stringify(account)},"time":"`;
  return (entryId, at, data) =>
    `{"specversion":"1.0","id":${id}${entryId}${after}${isoTime(at)}","datacontenttype":"application/json","data":${data}}`;
}

// Placeholders for id and head in pre-compact bundles (data starting with `{`): still read across an upgrade.
const ID_MARK = '\u0000';
const HEAD_MARK = '\u0001';

export const bundledId = (bundle: string, k: number | string) => `${bundle}.${k}`;

/** As usagebatch.lua wrote it (cursors.ts, READ_USAGE). */
export interface Bundle {
  id: string;
  /** Refunds included. */
  events: number;
  /** The account's bundled events up to this one: what the cursor counts by. */
  upto: number;
  /** bundleData's layout, or a pre-compact gateway's JSON with its marks. */
  data: string;
  /** `index units overage` per refund, space-separated ('': none). */
  refunds: string;
  /** Paid with credits: what paid each event, in line order (`g` the grant, `p` purchased credits, `-` none); '': not paid with credits. */
  credits?: string;
}

/** Request events, then a refund event per refund (`<bundle>.<k>.refund`) at the bundle's time. */
export function bundleEvents(account: string, source: string, b: Bundle, refundType = REFUND_TYPE): string {
  const id = JSON.stringify(eventId(account, b.id)).slice(1, -1);
  const shared = `","source":${JSON.stringify(source)},"type":"${REQUEST_TYPE}","subject":${JSON.stringify(account)},"time":"`;
  const paid = b.credits || undefined;
  let json = b.data.startsWith(COMPACT)
    ? compactEvents(`{"specversion":"1.0","id":"${id}.`, shared, b.data, paid)
    : b.data.replaceAll(ID_MARK, id).replaceAll(HEAD_MARK, shared);
  if (b.refunds === '') return json;
  const r = b.refunds.split(' ');
  const at = b.id.split('-')[0]!;
  for (let i = 0; i < r.length; i += 3) {
    const of = bundledId(b.id, r[i]!);
    // Its credit back (as purchased) if its request spent one (usagebatch.lua).
    const spent = paid?.[Number(r[i])] === 'g' || paid?.[Number(r[i])] === 'p';
    const f = { ref: of, units: r[i + 1]!, overage: r[i + 2]!, at, cr: spent ? r[i + 1]! : '0' };
    json += `,${JSON.stringify(refundEvent(account, source, `${of}.refund`, f, refundType))}`;
  }
  return json;
}

/**
 * requestEvent's JSON with one unit, no overage (a lease carries none), no balance (Redis holds a
 * credit lease's); `paid`, what paid each event (Bundle's `credits`): its creditsApplied.
 */
function compactEvents(start: string, shared: string, data: string, paid?: string): string {
  const [, names, from, heads, lines] = data.split(COMPACT) as [string, string, string, string, string];
  const at = Number(from);
  const keys = names.split(',').map((n, i) => `${i === 0 ? '{' : ','}${JSON.stringify(n)}:`);
  const last = keys.length - 1;
  const mids = heads.split('\n').map((h) => `,${h},"units":1,"status":`);
  const applied = (k: number) =>
    paid?.[k] === 'g'
      ? ',"creditsApplied":{"granted":1,"purchased":0}'
      : paid?.[k] === 'p'
        ? ',"creditsApplied":{"granted":0,"purchased":1}'
        : '';
  let json = '';
  // By position: no array of lines or values, each event one string.
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
      `"windows":${windows}},"overage":0,"credits":null${applied(k)}}}`;
    p = end + 1;
  }
  return json;
}

/** How each encoded event (or bundle of them) begins: its (first) id follows. */
const HEAD = '{"specversion":"1.0","id":"';
/** The encoded event's id (a bundle's: its first event's), or undefined. */
export const firstIdOf = (e: EncodedEvent) => (e.startsWith(HEAD) ? e.slice(HEAD.length, e.indexOf('"', HEAD.length)) : undefined);

/** For the rare sink batch smaller than a bundle: a quote in a value is escaped, so `between` only meets between events. */
export function splitEvents(json: string): string[] {
  const between = ',{"specversion":"1.0",';
  return json.split(between).map((e, i) => (i === 0 ? e : `{"specversion":"1.0",${e}`));
}

function refundEvent(account: string, source: string, id: string, f: Record<string, string>, type: string): CloudEvent {
  return {
    ...head(account, source, id, type, f.at!),
    data: {
      refundOf: eventId(account, f.ref!),
      units: -Number(f.units),
      ...(Number(f.overage) > 0 && { overage: -Number(f.overage) }),
      // The credits it gave back, as purchased ones (refund.lua, usagebatch.lua).
      ...(Number(f.cr) > 0 && { creditsReturned: Number(f.cr) }),
      // The request's statement line (refund.lua's; a bundle's refund gets its request's in the tally: periods.ts).
      ...(f.plan && { plan: f.plan, route: f.route }),
    },
  };
}

function creditsEvent(account: string, source: string, id: string, f: Record<string, string>): CloudEvent {
  const data: Record<string, unknown> = { ledgerEntry: f.ledger, amount: Number(f.amount), balance: Number(f.balance) };
  if (f.entry === 'grant') {
    Object.assign(data, { periods: Number(f.periods), expired: Number(f.expired), period: new Date(Number(f.period)).toISOString() });
  } else Object.assign(data, { reason: f.reason, idempotencyKey: f.idempotencyKey });
  return { ...head(account, source, id, CREDITS_TYPES[f.entry!]!, f.at!), data };
}

/** Carried by an older gateway's leased entry ('-': none known), else joined from `statuses` (undefined: not yet). */
function statusOf(id: string, f: Record<string, string>, statuses: ReadonlyMap<string, number>): number | null | undefined {
  if (f.status !== undefined) return f.status === '-' ? null : Number(f.status);
  return statuses.get(id);
}

/** A request without a status yet, younger than STATUS_WAIT_MS, stops the account's entries there. */
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

/** `joined`: the ids whose statuses came from `statuses`, deleted once the batch went. */
export function toCloudEvents(
  account: string,
  source: string,
  entries: UsageEntries,
  statuses: ReadonlyMap<string, number>,
  consumed: number,
  refundType = REFUND_TYPE,
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
      events.push(JSON.stringify(refundEvent(account, source, id, f, refundType)));
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
