// Pure header math: plain values and `now` in, header values out. No clock, no I/O.

export const MINUTE_MS = 60_000;
export const DAY_MS = 86_400_000;

export interface Limits {
  perMinute: number;
  /** 0: no day window (the unauthenticated per-address limit has only a minute). */
  perDay: number;
}

/** One window's state after the decision. `used` counts admitted requests only. */
export interface WindowState {
  name: 'minute' | 'day';
  limit: number;
  used: number;
  resetMs: number;
}

export type Decision =
  | { outcome: 'allowed'; nowMs: number; windows: WindowState[] }
  | { outcome: 'rejected'; violated: 'minute' | 'day'; nowMs: number; windows: WindowState[] }
  | { outcome: 'banned'; nowMs: number; banUntilMs: number; windows: WindowState[] };

/** Window boundaries are aligned to UTC: the minute at second :00, the day at 00:00. */
export function windowStart(nowMs: number, sizeMs: number): number {
  return nowMs - (nowMs % sizeMs);
}

/** The windows of a decision from the admitted counts of the current windows. */
export function windows(limits: Limits, nowMs: number, minuteUsed: number, dayUsed: number): WindowState[] {
  const list: WindowState[] = [
    { name: 'minute', limit: limits.perMinute, used: minuteUsed, resetMs: windowStart(nowMs, MINUTE_MS) + MINUTE_MS },
  ];
  if (limits.perDay > 0) {
    list.push({ name: 'day', limit: limits.perDay, used: dayUsed, resetMs: windowStart(nowMs, DAY_MS) + DAY_MS });
  }
  return list;
}

/** `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10); constant per limits, built at load. */
export function policyHeader(limits: Limits): string {
  const parts = [`"minute";q=${limits.perMinute};w=60`];
  if (limits.perDay > 0) parts.push(`"day";q=${limits.perDay};w=86400`);
  return parts.join(', ');
}

const remaining = (w: WindowState) => Math.max(0, w.limit - w.used);
/** Whole seconds until `atMs`, rounded up and never 0 while it is still ahead. */
const secondsUntil = (atMs: number, nowMs: number) => Math.max(1, Math.ceil((atMs - nowMs) / 1000));

/** The window the X- headers describe: the violated one, else the fewest remaining, the shorter on a tie. */
export function reportedWindow(d: Decision): WindowState {
  if (d.outcome === 'rejected') return d.windows.find((w) => w.name === d.violated)!;
  return d.windows.reduce((best, w) => (remaining(w) < remaining(best) ? w : best));
}

/**
 * When a window can admit again. During a ban nothing is admitted before the ban ends, and a
 * window already used up stays closed until its own reset if that comes later (a ban that
 * started with the day used up ends at midnight UTC in effect, not after 15 minutes).
 */
function reopensAt(d: Decision, w: WindowState): number {
  if (d.outcome !== 'banned') return w.resetMs;
  return remaining(w) === 0 ? Math.max(d.banUntilMs, w.resetMs) : d.banUntilMs;
}

/** Seconds a refused client should wait: until a request can be admitted again. */
export function retryAfterSeconds(d: Decision): number | undefined {
  if (d.outcome === 'banned') return secondsUntil(Math.max(...d.windows.map((w) => reopensAt(d, w))), d.nowMs);
  if (d.outcome === 'rejected') return secondsUntil(reportedWindow(d).resetMs, d.nowMs);
  return undefined;
}

/** Every rate-limit header of a response. During a ban every window reports 0 left. */
export function rateLimitHeaders(d: Decision, policy: string): Record<string, string> {
  const w = reportedWindow(d);
  const banned = d.outcome === 'banned';
  const resetMs = banned ? d.banUntilMs : w.resetMs;
  const state = d.windows
    .map((x) => `"${x.name}";r=${banned ? 0 : remaining(x)};t=${secondsUntil(reopensAt(d, x), d.nowMs)}`)
    .join(', ');
  const headers: Record<string, string> = {
    'x-ratelimit-limit': String(w.limit),
    'x-ratelimit-remaining': String(banned ? 0 : remaining(w)),
    'x-ratelimit-reset': String(Math.ceil(resetMs / 1000)),
    'ratelimit-policy': policy,
    ratelimit: state,
  };
  const retry = retryAfterSeconds(d);
  if (retry !== undefined) headers['retry-after'] = String(retry);
  return headers;
}

export interface DeprecationInput {
  deprecatedAtMs: number;
  sunsetMs: number;
  successor: string;
  documentation?: string;
}

/** RFC 9745 Deprecation (`@seconds`), RFC 8594 Sunset (IMF-fixdate, GMT) and the Link relations. */
export function deprecationHeaders(d: DeprecationInput): Record<string, string> {
  const links = [`<${d.successor}>; rel="successor-version"`];
  if (d.documentation) {
    links.unshift(`<${d.documentation}>; rel="deprecation"; type="text/html"`);
    links.push(`<${d.documentation}>; rel="sunset"; type="text/html"`);
  }
  return {
    deprecation: `@${Math.floor(d.deprecatedAtMs / 1000)}`,
    sunset: new Date(d.sunsetMs).toUTCString(),
    link: links.join(', '),
  };
}
