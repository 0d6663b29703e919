import { jsonString } from '../json.js';
import type { EventTag } from './decision.js';
import { compiled, type Counts, FIXED } from './windows.js';

// A bundle's layout: the value usagebatch.lua writes to an account's `bundles` stream, one per
// call, holding leased admissions' usage events. Its writer is the Redis store (quota/redis/),
// its reader the exporter (usage/events.ts, bundleEvents): a wire, named here once for both.

/**
 * A leased admission's windows as its bundle line carries them (eventLine): each fixed window's
 * count (FIXED's order; null where the subject has none, `limits`: fixedLimits of its limits),
 * then the billing period's (null when 0), comma-separated, the JSON values eventWindows gives
 * them. Built from the rows once: the names are the rows' own identifiers, never input.
 */
export const windowsLine = compiled<(counts: Counts, limits: readonly number[], month: number) => string>(
  'counts, limits, month',
  `return ${FIXED.map((w, i) => (w.always ? `(counts.${w.used} ?? 0)` : `(limits[${i}] > 0 ? (counts.${w.used} ?? 0) : 'null')`)).join(" + ',' + ")} + ',' + (month || 'null');`,
);
/** The names windowsLine's values go by, in its order: a bundle names them, so it reads the same whatever rows its reader has. */
const WINDOW_NAMES = [...FIXED.map((w) => w.name), 'month'].join(',');

/**
 * What a leased admission's event shares with the account's other events of its key, route and
 * method: its data's `keyId` to `method`, in JSON (a bundle holds each once, its lines name it).
 */
export function eventHead(tag: Pick<EventTag, 'keyId' | 'plan' | 'route' | 'method'>): string {
  const q = JSON.stringify;
  return `"keyId":${q(tag.keyId)},"plan":${q(tag.plan)},"route":${q(tag.route)},"method":${q(tag.method)}`;
}

/**
 * Leased admissions' events are written a bundle a call (usagebatch.lua: one stream entry, the
 * account's `bundles`), holding only what varies from event to event: the exporter, on its own
 * thread, adds what they share (bundleEvents). Its data, in this layout, is COMPACT, the
 * windows' names (comma-separated), COMPACT, the time (Redis ms) its events' times count from,
 * COMPACT, the heads (eventHead, a line each), COMPACT, then a line per event (eventLine). JSON
 * never leaves a control character raw, so neither COMPACT nor a newline can occur inside a
 * head or a request id.
 */
export const COMPACT = '\u0002';

/**
 * A leased admission's event in its bundle: the index of its head among the bundle's, its
 * admission time as ms from the bundle's time (`since`: a small integer, which is quicker to
 * print than a time), its status (null: none known), its windows (windowsLine) and its request
 * id in JSON, space-separated, the request id last.
 */
export const eventLine = (head: number, since: number, status: number | null, windows: string, requestId: string) =>
  `${head} ${since} ${status} ${windows} ${jsonString(requestId)}`;

/** A bundle's data (usagebatch.lua's `data`): its time (Redis ms), its heads (eventHead) and its events' lines (eventLine). */
export const bundleData = (at: number, heads: readonly string[], lines: readonly string[]) =>
  `${COMPACT}${WINDOW_NAMES}${COMPACT}${at}${COMPACT}${heads.join('\n')}${COMPACT}${lines.join('\n')}`;
